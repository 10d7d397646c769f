"""`python -m load_tests.forward_bench`: this stack against llama.cpp's server, side by side, over HTTP.

Both servers are started by the benchmark, one after the other, on the same machine:
- iterserve: `serve run serve_config.yaml`, exactly as `make serve` runs it (its own local Ray);
- llamacpp:  llama.cpp's server (`xllamacpp`, load_tests.llamacpp_server) on the embedded model's own
             4-bit GGUF, 2 threads, 64 slots.
Each gets the same chats (random-word prompts with distinct starts, greedy, EOS ignored so every answer
has exactly --output-tokens tokens), streamed by the load generator's client (load_tests.bench_client):
- single: --chats chats one at a time: first-token (TTFT) p50/p90, and one stream's decode speed,
          (tokens after the first) / (time after the first token) = 1 / TPOT, p50 over the chats;
- burst:  --burst chats at t=0: output tokens/s over the burst, TTFT p50.
Targets (issue 21), as ratios to llama.cpp: single TTFT p50 <= 2x, decode speed >= 0.5x, burst
output tokens/s >= 1.5x. With --repeat R each scenario runs R times per system and the table shows the
median of each figure. Prints the table, writes results/forward_bench/forward_bench.json and both logs.
llama.cpp's 4-bit answers differ from the fp32 ones: it is a speed anchor, not an output oracle.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from cluster.local_serve import free_port
from load_tests.bench_client import BenchRecord, LoadResult, Target, run_load
from load_tests.bench_metrics import percentile, summarize
from load_tests.bench_workloads import random_requests

SYSTEMS = ("iterserve", "llamacpp")
PEER = "llamacpp"
# (label, scenario, figure, format, target: (comparison, ratio iterserve / llama.cpp) or None)
ROWS = [
    ("single: TTFT p50 (ms)", "single", "ttft_p50_ms", "{:.1f}", ("<=", 2.0)),
    ("single: TTFT p90 (ms)", "single", "ttft_p90_ms", "{:.1f}", None),
    ("single: decode tok/s p50", "single", "decode_tok_s_p50", "{:.1f}", (">=", 0.5)),
    ("burst: output tok/s", "burst", "output_tok_s", "{:.1f}", (">=", 1.5)),
    ("burst: TTFT p50 (ms)", "burst", "ttft_p50_ms", "{:.0f}", None),
]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.forward_bench", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--chats", type=int, default=20, help="single scenario: chats one at a time")
    p.add_argument("--burst", type=int, default=64, help="burst scenario: chats at t=0")
    p.add_argument("--output-tokens", type=int, default=64, help="every answer's length (EOS ignored)")
    p.add_argument("--input-len", type=int, default=32, help="prompt words (about one token each)")
    p.add_argument("--repeat", type=int, default=1, help="runs of both scenarios per system; medians shown")
    p.add_argument("--config", default="serve_config.yaml", help="iterserve's serve config (its port is replaced)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's compute threads")
    p.add_argument("--slots", type=int, default=64, help="llama.cpp's parallel slots")
    p.add_argument("--gguf", default=None, help="llama.cpp's model; default: the embedded model's GGUF")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/forward_bench", help="JSON and server logs go here")
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS) - {""}
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def workload(args) -> dict:
    """Distinct prompts per scenario (no answer is served from another's cache); the warm-up is a
    short burst of the same width, so both scenarios' batch shapes have been seen once."""

    def chats(n: int, tokens: int, seed: int):
        return random_requests(n, args.input_len, tokens, 0.0, "chat", seed)

    return {
        "warmup": chats(args.burst, 8, args.seed + 2) + chats(2, 8, args.seed + 3),
        "single": chats(args.chats, args.output_tokens, args.seed),
        "burst": chats(args.burst, args.output_tokens, args.seed + 1),
    }


def decode_speed(record: BenchRecord) -> Optional[float]:
    """One stream's tokens after the first over its time after the first token (1 / TPOT)."""
    tpot = record.tpot_s
    return 1.0 / tpot if tpot else None


def _common(result: LoadResult, summary: dict) -> dict:
    ok = [r for r in result.records if r.ok]
    return {
        "requests": summary["requests"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "output_lengths": sorted({r.output_tokens for r in ok}),
        "prompt_tokens_p50": percentile([r.prompt_tokens for r in ok if r.prompt_tokens], 50),
        "errors": [r.error for r in result.records if not r.ok][:5],
        "records": [asdict(r) for r in result.records],
    }


def single_figures(result: LoadResult) -> dict:
    s = summarize(result.records, result.duration_s)
    speeds = [v for v in map(decode_speed, (r for r in result.records if r.ok)) if v is not None]
    return {
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p90_ms": s["ttft_ms"]["p90"],
        "decode_tok_s_p50": percentile(speeds, 50),
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        **_common(result, s),
    }


def burst_figures(result: LoadResult) -> dict:
    s = summarize(result.records, result.duration_s)
    return {
        "output_tok_s": s["output_throughput"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "e2e_p50_ms": s["e2e_ms"]["p50"],
        "duration_s": result.duration_s,
        **_common(result, s),
    }


async def measure(target: Target, requests: dict, repeat: int, timeout_s: float) -> dict:
    """Warm-up, then `repeat` x (single, burst); every run's figures and the median of each."""
    await run_load(target, requests["warmup"], timeout_s=timeout_s)
    runs = []
    for _ in range(repeat):
        load = os.getloadavg()[0]
        single = await run_load(target, requests["single"], max_concurrency=1, timeout_s=timeout_s)
        burst = await run_load(target, requests["burst"], timeout_s=timeout_s)
        runs.append({"single": single_figures(single), "burst": burst_figures(burst), "load_avg_1m_before": load})
    return {"runs": runs, "figures": medians(runs)}


def medians(runs: List[dict]) -> Dict[str, dict]:
    """Per scenario, the median over runs of every figure in ROWS (None where a run has none)."""
    out: Dict[str, dict] = {}
    for _, scenario, key, _, _ in ROWS:
        values = [r[scenario][key] for r in runs if r[scenario][key] is not None]
        out.setdefault(scenario, {})[key] = statistics.median(values) if values else None
    return out


def targets(by_system: Dict[str, dict]) -> List[dict]:
    """Each targeted figure: iterserve's, llama.cpp's, the ratio, met or not. No ratio where either
    system failed a request of that scenario (a burst cut short is no throughput to compare)."""
    if "iterserve" not in by_system or PEER not in by_system:
        return []
    out = []
    for label, scenario, key, _, target in ROWS:
        if target is None:
            continue
        pair = [by_system[n] for n in ("iterserve", PEER)]
        failed = sum(run[scenario].get("failed", 0) for system in pair for run in system["runs"])
        ours, theirs = (system["figures"][scenario][key] for system in pair)
        ratio = ours / theirs if ours is not None and theirs and not failed else None
        op, bound = target
        met = ratio is not None and (ratio <= bound if op == "<=" else ratio >= bound)
        out.append(
            {
                "figure": label,
                "iterserve": ours,
                PEER: theirs,
                "ratio": ratio,
                "target": f"{op} {bound:g}x",
                "met": met,
                "failed_requests": failed,
            }
        )
    return out


def format_table(by_system: Dict[str, dict], checks: List[dict]) -> str:
    names = list(by_system)
    by_label = {c["figure"]: c for c in checks}
    lines = [f"{'':<26}" + "".join(f"{n:>11}" for n in names) + ("    ratio  target" if checks else "")]
    for label, scenario, key, fmt, _ in ROWS:
        vals = [by_system[n]["figures"][scenario][key] for n in names]
        line = f"{label:<26}" + "".join(f"{fmt.format(v) if v is not None else '-':>11}" for v in vals)
        if label in by_label:
            c = by_label[label]
            ratio = f"{c['ratio']:>6.2f}x" if c["ratio"] is not None else f"{'-':>7}"
            verdict = (
                f"failed requests: {c['failed_requests']}"
                if c["failed_requests"]
                else ("met" if c["met"] else "MISSED")
            )
            line += f"  {ratio}  {c['target']} {verdict}"
        lines.append(line)
    for scenario in ("single", "burst"):
        lines.append(
            f"{scenario + ': done/sent, lengths':<26}"
            + "".join(f"{_done(by_system[n]['runs'], scenario):>11}" for n in names)
        )
    return "\n".join(lines)


def _done(runs: List[dict], scenario: str) -> str:
    done, sent = sum(r[scenario]["completed"] for r in runs), sum(r[scenario]["requests"] for r in runs)
    lengths = sorted({n for r in runs for n in r[scenario]["output_lengths"]})
    return f"{done}/{sent} {','.join(map(str, lengths)) or '-'}"


def run_system(name: str, args, requests: dict) -> dict:
    out = Path(args.out)
    if name == "iterserve":
        from load_tests.servers import serve_run

        server = serve_run(args.config, free_port(), out / "iterserve.log", args.start_timeout_s)
    else:
        from load_tests.llamacpp_server import llamacpp_server

        # More HTTP threads than connections at once (the burst), or llama.cpp drops the extra ones.
        server = llamacpp_server(
            free_port(),
            out / "llamacpp.log",
            args.gguf,
            args.threads,
            args.slots,
            http_threads=max(args.burst, args.slots) + 16,
            start_timeout_s=args.start_timeout_s,
        )
    print(f"\n== {name}: starting...", flush=True)
    started = time.perf_counter()
    with server as url:
        print(
            f"   ready in {time.perf_counter() - started:.0f} s; warm-up, then {args.repeat} x "
            f"({args.chats} chats one at a time, {args.burst} at t=0)",
            flush=True,
        )
        result = asyncio.run(measure(Target(url), requests, args.repeat, args.timeout_s))
    f = result["figures"]
    print(
        f"   TTFT p50 {f['single']['ttft_p50_ms'] or 0:.1f} ms, decode {f['single']['decode_tok_s_p50'] or 0:.1f} "
        f"tok/s, burst {f['burst']['output_tok_s'] or 0:.1f} tok/s ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return result


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    requests = workload(args)
    print(
        f"forward bench: {args.chats} chats one at a time and {args.burst} at t=0, {args.output_tokens} output "
        f"tokens each, ~{args.input_len}-word prompts, x{args.repeat}; load avg {os.getloadavg()[0]:.1f}"
    )
    started = time.perf_counter()
    by_system = {name: run_system(name, args, requests) for name in systems}
    checks = targets(by_system)
    print("\n" + format_table(by_system, checks))
    result = {
        "benchmark": "forward_bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "args": vars(args),
        "systems": by_system,
        "targets": checks,
        "total_seconds": time.perf_counter() - started,
    }
    path = Path(args.out) / "forward_bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path} ({result['total_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
