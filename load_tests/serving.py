"""`python -m load_tests.serving` (`make bench-serving`): this stack against `transformers serve`, side by side.

Both servers are started by the benchmark, one after the other, on the same machine and model:
- iterserve: `serve run serve_config.yaml`, exactly as `make serve` runs it (its own local Ray);
- peer:      `transformers serve MODEL_DIR --continuous-batching` (same model, fp32, all cores), EOS
             disabled through its `generation_config`.
Each gets the same chat requests (random-word prompts, capped-exponential output lengths, EOS
ignored, greedy), streamed over HTTP by the load generator's client (load_tests.bench_client):
- saturated: every request at t=0; output tokens/s over the whole burst;
- light:     one request at a time; time to first token p50/p99 and time per output token.
Targets (issue 9): saturated throughput >= 1.8x the peer's, light TTFT p50 <= 0.8x and p99 <= 1x the
peer's. Greedy answers are compared: each system's saturated answers against its own one-at-a-time
answers (batching must not change them) and against the other system's.
Prints the table, writes JSON; bounded by a request count per phase and a timeout per request.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from cluster.local_serve import free_port
from load_tests.bench_client import BenchRequest, Target, run_load
from load_tests.bench_metrics import summarize
from load_tests.bench_workloads import variance_requests
from load_tests.servers import peer_server, serve_run
from load_tests.serving_report import cpu_seconds, report

SYSTEMS = ("iterserve", "peer")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.serving", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--config", default="serve_config.yaml", help="iterserve's serve config (its port is replaced)")
    p.add_argument("--model-dir", default=None, help="the peer's model; default: the embedded model's directory")
    p.add_argument("--num-requests", type=int, default=64, help="saturated phase: chat requests at t=0")
    p.add_argument("--input-len", type=int, default=64, help="prompt words (about one token each)")
    p.add_argument("--mean-output", type=float, default=50.0)
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--light-requests", type=int, default=30, help="light phase: requests one at a time")
    p.add_argument("--light-output", type=int, default=16, help="max output tokens in the light phase")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/serving", help="JSON and server logs go here")
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="both engines on this many torch threads (iterserve: engine.num_threads and "
        "replica.num_cpus; the peer: OMP_NUM_THREADS); default: each as configured (2 here)",
    )
    return p.parse_args(argv)


def workload(args) -> Dict[str, List[BenchRequest]]:
    saturated = variance_requests(args.num_requests, args.input_len, args.mean_output, args.cap, "chat", args.seed)
    # Light requests are the first saturated ones, shorter: their answers must be prefixes of those.
    light = [
        BenchRequest(messages=r.messages, max_tokens=min(r.max_tokens, args.light_output), ignore_eos=True)
        for r in saturated[: args.light_requests]
    ]
    warmup = variance_requests(args.warmup, args.input_len, 8, 8, "chat", args.seed + 1)
    return {"saturated": saturated, "light": light, "warmup": warmup}


async def measure(target: Target, requests: Dict[str, List[BenchRequest]], timeout_s: float) -> dict:
    """Warm-up, then the saturated burst, then the light phase; summaries and answers of both."""
    await run_load(target, requests["warmup"], max_concurrency=4, timeout_s=timeout_s)
    cpu0 = cpu_seconds()
    sat = await run_load(target, requests["saturated"], timeout_s=timeout_s)
    cpu = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu_seconds().items() if v - cpu0.get(k, 0.0) > 0.05}
    light = await run_load(target, requests["light"], max_concurrency=1, timeout_s=timeout_s)
    out = {}
    for phase, res in (("saturated", sat), ("light", light)):
        records = sorted(res.records, key=lambda r: r.index)
        out[phase] = {
            "summary": summarize(records, res.duration_s),
            "answers": [r.output_text for r in records],
            "output_tokens": [r.output_tokens for r in records],
            "errors": [r.error for r in records if not r.ok][:5],
        }
    out["saturated"]["cpu_seconds"] = cpu
    return out


def run_system(name: str, args, requests) -> dict:
    out = Path(args.out)
    if name == "iterserve":
        threads = args.engine_threads
        update = {"engine": {"num_threads": threads}, "replica": {"num_cpus": threads}} if threads else None
        server = serve_run(args.config, free_port(), out / "iterserve.log", args.start_timeout_s, args_update=update)
        target_of = lambda url: Target(url)  # noqa: E731
    else:
        from batcher.model_files import embedded_model_dir

        model_dir = args.model_dir or str(embedded_model_dir())
        server = peer_server(model_dir, free_port(), out / "peer.log", args.start_timeout_s, args.engine_threads)
        target_of = lambda url: Target(url, model=model_dir, ignore_eos_as="generation_config")  # noqa: E731
    print(f"\n== {name}: starting...", flush=True)
    with server as url:
        started = time.perf_counter()
        result = asyncio.run(measure(target_of(url), requests, args.timeout_s))
    s, lt = result["saturated"]["summary"], result["light"]["summary"]
    print(
        f"   {s['output_throughput']:.1f} out tok/s saturated ({s['completed']}/{s['requests']} done), "
        f"light TTFT p50 {lt['ttft_ms']['p50'] or 0:.0f} ms ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return result


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    requests = workload(args)
    expected = sum(r.max_tokens for r in requests["saturated"])
    print(
        f"workload: {args.num_requests} chat requests at t=0 ({expected} output tokens), then "
        f"{args.light_requests} one at a time (<= {args.light_output} tokens); load avg {os.getloadavg()[0]:.1f}"
        + (f"; both engines on {args.engine_threads} torch thread(s)" if args.engine_threads else "")
    )
    started = time.perf_counter()
    by_system = {name: run_system(name, args, requests) for name in systems}
    result = {
        "benchmark": "serving",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "args": vars(args),
        "expected_output_tokens": expected,
        "systems": by_system,
        "targets": report(by_system, requests),
        "total_seconds": time.perf_counter() - started,
    }
    path = Path(args.out) / "serving.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path} ({result['total_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
