"""`python -m load_tests.bench`: load-test any OpenAI-compatible server (this app, vLLM, transformers serve).

    python -m load_tests.bench --base-url http://127.0.0.1:8000 --workload variance --cap 128 \
        --num-requests 64 --request-rate 1,2,4 --goodput ttft:1000 tpot:200

Sends a seeded workload (random, variance, chats or a JSONL file) as chat or completions requests,
streaming, with Poisson or gamma arrivals at each rate of `--request-rate` (inf: all at once), or at
most `--max-concurrency` in flight; bounded by `--num-requests` and `--duration-s`. Prints a table
per rate and a sweep table; writes JSON with every request's record and each run's summary.

`--workload trace --trace FILE_OR_NAME` replays a request trace instead (cluster.request_traces: CSV
or Mooncake-style JSONL, or a bundled one): each request at its time in the trace, with its lengths,
as completions with token-id prompts that share the prefixes its block ids share.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Sequence

from cluster.request_traces import RequestTrace, bundled, load_request_trace
from load_tests import bench_workloads as wl
from load_tests.arrivals import arrival_offsets, parse_rates
from load_tests.bench_client import BenchRequest, Target, run_load
from load_tests.bench_metrics import format_summary, format_sweep, parse_slos, summarize

DEFAULT_NUM_REQUESTS = 64  # every workload but a trace, which replays whole unless bounded


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.bench", description=__doc__.splitlines()[0])
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--api", choices=("chat", "completions"), help="default: chat (a trace: completions)")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT = e2e)")
    g.add_argument(
        "--ignore-eos-as",
        choices=("field", "generation_config", "none"),
        default="field",
        help="how to ask for EOS to be ignored: `ignore_eos` (vLLM, iterserve) or "
        "`generation_config` (transformers serve); none: let EOS end answers",
    )
    g.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    g.add_argument("--header", action="append", default=[], help="K:V, repeatable (e.g. Authorization:Bearer x)")
    g.add_argument("--record-header", action="append", default=[], help="response header kept per request")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("random", "variance", "chats", "jsonl", "trace"), default="random")
    g.add_argument(
        "--num-requests",
        type=int,
        help=f"requests (chats: sessions) per run (default {DEFAULT_NUM_REQUESTS}; a trace: all of it)",
    )
    g.add_argument("--input-len", type=int, default=64, help="prompt tokens (about one per word for text)")
    g.add_argument("--output-len", type=int, default=64, help="random: output tokens; jsonl: default max_tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1 +- r)")
    g.add_argument("--token-ids", action="store_true", help="random/variance: token-id prompts (completions)")
    g.add_argument("--mean-output", type=float, default=32.0, help="variance: exponential mean")
    g.add_argument("--cap", type=int, default=128, help="variance: output-length cap")
    g.add_argument("--num-prefixes", type=int, default=4, help="chats: shared system prompts")
    g.add_argument("--prefix-len", type=int, default=256, help="chats: system prompt words")
    g.add_argument("--turns", type=int, default=3, help="chats: turns per session")
    g.add_argument("--user-len", type=int, default=32, help="chats: words per user turn")
    g.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="chats: mean seconds a user thinks before each later turn (exponential; 0: at once)",
    )
    g.add_argument("--dataset", help="jsonl: path of the file")
    g = p.add_argument_group("trace (sent at the trace's times, not --request-rate)")
    g.add_argument("--trace", help="a CSV or JSONL request trace, or a bundled one by name (load_tests/traces/)")
    g.add_argument("--window-s", nargs=2, type=float, metavar=("START", "END"), help="only [START, END) of the trace")
    g.add_argument("--speedup", type=float, default=1.0, help="gaps divided by this (rates multiplied)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="about this many times the requests, same shape")
    g.add_argument(
        "--at-ticks",
        action="store_true",
        help="a trace recorded at ticks (Mooncake's: 3 s): send each "
        "tick's requests together at its timestamp, not spread over the tick",
    )
    g.add_argument(
        "--token-scale", type=float, default=1.0, help="prompt and prefix-block lengths times this (e.g. 0.1)"
    )
    g.add_argument("--output-cap", type=int, help="max_tokens at most this")
    g.add_argument("--tokenizer", help="whose text-token ids make the prompts (default: the served model's)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", help="req/s; comma separated for a sweep; inf = all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    g.add_argument("--duration-s", type=float, help="send nothing new after this many seconds")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    g.add_argument("--warmup", type=int, default=0, help="requests sent together first, not counted")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    g.add_argument("--percentiles", default="50,90,99")
    g.add_argument("--json", default="results/bench.json", help="output file ('' = none)")
    g.add_argument("--no-records", action="store_true", help="leave per-request records out of the JSON")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.trace and args.workload != "trace":
        p.error("--trace goes with --workload trace")
    if args.workload == "trace":
        if not args.trace:
            p.error("--workload trace needs --trace FILE_OR_BUNDLED_NAME")
        if args.request_rate != "inf" or args.burstiness != 1.0:
            p.error(
                "a trace's own times are the arrivals: --request-rate and --burstiness do not apply "
                "(--speedup and --rate-scale change its rate)"
            )
        if args.api == "chat":
            p.error(
                "--workload trace replays token-id prompts (exact lengths and shared prefixes) through the "
                "completions API: leave out --api chat"
            )
        args.api = "completions"
    args.api = args.api or "chat"
    return args


def build_workload(args) -> List[BenchRequest]:
    n = DEFAULT_NUM_REQUESTS if args.num_requests is None else args.num_requests
    if args.workload == "random":
        return wl.random_requests(
            n, args.input_len, args.output_len, args.range_ratio, args.api, args.seed, args.token_ids
        )
    if args.workload == "variance":
        return wl.variance_requests(n, args.input_len, args.mean_output, args.cap, args.api, args.seed, args.token_ids)
    if args.workload == "chats":
        if args.api != "chat":
            raise SystemExit("--workload chats needs --api chat")
        return wl.shared_prefix_chats(
            n, args.num_prefixes, args.prefix_len, args.turns, args.user_len, args.output_len, args.seed
        )
    if not args.dataset:
        raise SystemExit("--workload jsonl needs --dataset PATH")
    return wl.jsonl_requests(args.dataset, args.api, args.output_len, n, ignore_eos=args.ignore_eos_as != "none")


def load_trace(args) -> RequestTrace:
    """The trace to replay: windowed, sped up, rate-scaled, then bounded by --duration-s and --num-requests."""
    path = Path(args.trace)
    try:
        trace = load_request_trace(path if path.exists() else bundled(args.trace))
        if not args.at_ticks:
            trace = trace.spread_ticks(args.seed)
        if args.window_s:
            trace = trace.window(*args.window_s)
        if args.speedup != 1.0:
            trace = trace.time_scaled(args.speedup)
        if args.rate_scale != 1.0:
            trace = trace.rate_scaled(args.rate_scale, args.seed)
    except FileNotFoundError as e:
        raise SystemExit(f"--trace: {args.trace} is no file here, and {e}") from None
    except ValueError as e:
        raise SystemExit(f"--trace: {e}") from None
    if args.duration_s is not None:
        trace = trace.window(0.0, args.duration_s)
    if args.num_requests is not None:
        trace = trace.head(args.num_requests)
    if not len(trace):
        raise SystemExit(f"--trace {args.trace}: no requests left after the window and bounds")
    return trace


def trace_token_range(args, target: Target) -> tuple:
    """[low, high) of the ordinary text-token ids of --tokenizer or the served model; the embedded model's
    when that tokenizer cannot be loaded here (fine while the server's vocabulary is at least as large)."""
    import httpx

    from batcher.model_files import EMBEDDED_MODEL, load_tokenizer
    from load_tests.workload import text_token_range

    name = args.tokenizer or target.model
    if name is None:
        r = httpx.get(f"{target.root}/v1/models", headers=target.headers, timeout=30.0)
        r.raise_for_status()
        name = r.json()["data"][0]["id"]
    try:
        return text_token_range(load_tokenizer(name))
    except Exception as e:  # not on this machine, not a tokenizer: say so and go on with the embedded one
        print(
            f"tokenizer {name!r} not loadable here ({type(e).__name__}); prompts use {EMBEDDED_MODEL}'s "
            "token ids (pass --tokenizer if the server's vocabulary is smaller)",
            file=sys.stderr,
        )
        return text_token_range(load_tokenizer(EMBEDDED_MODEL))


def target_from_args(args) -> Target:
    headers = dict(h.split(":", 1) for h in args.header)
    return Target(
        args.base_url,
        api=args.api,
        model=args.model,
        stream=not args.no_stream,
        ignore_eos_as=args.ignore_eos_as,
        extra_body=json.loads(args.extra_body),
        headers={k.strip(): v.strip() for k, v in headers.items()},
        record_headers=tuple(h.lower() for h in args.record_header),
    )


async def sweep(
    target: Target,
    requests: Sequence[BenchRequest],
    rates: Sequence[float],
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    max_concurrency: Optional[int] = None,
    duration_s: Optional[float] = None,
    timeout_s: float = 600.0,
    slos=None,
    percentiles=(50, 90, 99),
    warmup: int = 0,
    progress: bool = True,
    label: str = "",
    keep_records: bool = True,
    echo: bool = True,
    think_s: float = 0.0,
) -> List[dict]:
    """One run per rate, the same requests each time; returns rows {label, rate, summary, records}."""
    if warmup:  # together, so the server also sees a batch before the first measured run
        await run_load(target, [requests[i % len(requests)] for i in range(warmup)], timeout_s=timeout_s)
    rows = []
    for rate in rates:
        arrivals = arrival_offsets(len(requests), rate, burstiness, seed)
        result = await run_load(
            target, requests, arrivals, max_concurrency, duration_s, timeout_s, progress, think_s=think_s, seed=seed
        )
        summary = summarize(result.records, result.duration_s, slos, percentiles)
        row = {"label": label or target.root, "rate": rate, "burstiness": burstiness, "summary": summary}
        if keep_records:
            row["records"] = [asdict(r) for r in result.records]
        rows.append(row)
        if echo:
            print(format_summary(summary, f"{label or target.root} at {rate:g} req/s"), flush=True)
    return rows


async def replay(
    target: Target,
    trace: RequestTrace,
    requests: Sequence[BenchRequest],
    *,
    max_concurrency: Optional[int] = None,
    duration_s: Optional[float] = None,
    timeout_s: float = 600.0,
    slos=None,
    percentiles=(50, 90, 99),
    warmup: int = 0,
    progress: bool = True,
    keep_records: bool = True,
) -> dict:
    """One run sending requests[i] at trace.t_s[i]; the row carries the trace's describe()."""
    if warmup:
        await run_load(target, [requests[i % len(requests)] for i in range(warmup)], timeout_s=timeout_s)
    result = await run_load(target, requests, trace.t_s.tolist(), max_concurrency, duration_s, timeout_s, progress)
    summary = summarize(result.records, result.duration_s, slos, percentiles)
    described = trace.describe()
    row = {"label": f"trace {trace.name}", "rate": described["mean_rps"], "trace": described, "summary": summary}
    if keep_records:
        row["records"] = [asdict(r) for r in result.records]
    print(
        format_summary(
            summary, f"{target.root}: trace {trace.name} ({len(trace)} requests, {described['duration_s']:g} s)"
        ),
        flush=True,
    )
    return row


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    target = target_from_args(args)
    slos = parse_slos(args.goodput)
    percentiles = [float(p) for p in args.percentiles.split(",")]
    bounds = dict(
        max_concurrency=args.max_concurrency,
        duration_s=args.duration_s,
        timeout_s=args.timeout_s,
        slos=slos,
        percentiles=percentiles,
        warmup=args.warmup,
        progress=not args.no_progress,
        keep_records=not args.no_records,
    )
    if args.workload == "trace":
        trace = load_trace(args)
        requests = wl.TraceRequests(
            trace,
            trace_token_range(args, target),
            args.token_scale,
            args.output_cap,
            args.ignore_eos_as != "none",
            args.seed,
        )
        rows = [asyncio.run(replay(target, trace, requests, **bounds))]
    else:
        rows = asyncio.run(
            sweep(
                target,
                build_workload(args),
                parse_rates(args.request_rate),
                burstiness=args.burstiness,
                seed=args.seed,
                think_s=args.think_s,
                **bounds,
            )
        )
    if len(rows) > 1:
        print("\n" + format_sweep(rows))
    result = {
        "benchmark": "bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": vars(args),
        "runs": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
