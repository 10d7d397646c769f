"""`python -m load_tests.experiment`: the seeds' experiment through the whole stack, with pictures.

Four systems, one after another on the same machine, the same requests (the variance workload:
random-word chat prompts, capped-exponential output lengths, EOS ignored), a sweep of Poisson request
rates through each, streamed over HTTP by the load generator (load_tests.bench):
- static:     this application (Ray Serve, one replica) with `scheduling: static` (fixed batches);
- continuous: the same application with `scheduling: continuous`;
- peer:       `transformers serve MODEL_DIR --continuous-batching` (the outside peer, same model,
              same dtype, same cores), EOS disabled through its `generation_config`;
- llamacpp:   llama.cpp's server (load_tests.llamacpp_server) on the embedded model's own 4-bit GGUF,
              --threads threads, --max-num-seqs slots (only with the embedded model).
Then the batch-occupancy picture from real in-process engine traces (static next to continuous).
Writes PNGs, an HTML page and JSON under --out, prints the table and the targets. Bounded: a fixed
number of requests per rate, a timeout per request; `--quick` for a smoke run of a minute or two.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from batcher.model_files import EMBEDDED_MODEL
from cluster.local_serve import free_port, local_serve
from load_tests.arrivals import parse_rates
from load_tests.bench import sweep
from load_tests.bench_client import Target
from load_tests.bench_metrics import parse_slos
from load_tests.bench_workloads import variance_requests
from load_tests.experiment_report import write_report
from load_tests.servers import peer_server

SYSTEMS = ("static", "continuous", "peer", "llamacpp")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.experiment", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--rates", default="1,2,4,8", help="Poisson request rates (req/s), comma separated")
    p.add_argument("--num-requests", type=int, default=24, help="per rate, at least")
    p.add_argument(
        "--window-s",
        type=float,
        default=20.0,
        help="per rate: max(num-requests, rate x window) requests, so fast rates run long enough "
        "that the drain at the end does not dominate",
    )
    p.add_argument("--input-len", type=int, default=64, help="prompt words (about one token each)")
    p.add_argument("--mean-output", type=float, default=32.0)
    p.add_argument("--cap", type=int, default=128)
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads of the engine, and llama.cpp's threads (the peer uses all cores)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:250"], metavar="NAME:MS")
    p.add_argument("--occupancy-requests", type=int, default=32)
    p.add_argument("--occupancy-slots", type=int, default=8)
    p.add_argument("--peer-port", type=int, default=0, help="0: a free port")
    p.add_argument("--peer-start-timeout-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/experiment")
    p.add_argument("--quick", action="store_true", help="8 requests at 2 and 8 req/s, short outputs")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.num_requests, args.window_s, args.mean_output, args.cap = "2,8", 8, 0.0, 8.0, 16
        args.occupancy_requests = 16
    return args


def app_config(args, scheduling: str) -> dict:
    engine = {
        "model": args.model,
        "device": "cpu",
        "dtype": "float32",
        "num_threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "scheduling": scheduling,
        "static_batch_size": args.static_batch_size,
    }
    return {"engine": engine, "replica": {"max_ongoing_requests": 1024, "max_queued_requests": 4096}}


def requests_at(rate: float, args) -> int:
    return max(args.num_requests, int(rate * args.window_s))


def run_sweep(name: str, target: Target, requests, args, slos) -> List[dict]:
    """One run per rate over the first requests_at(rate) requests; 8 warm-up requests first."""
    print(f"\n== {name}: rates {args.rates} req/s ({target.root})", flush=True)
    rows = []
    for i, rate in enumerate(parse_rates(args.rates)):
        load0 = os.getloadavg()[0]
        [row] = asyncio.run(
            sweep(
                target,
                requests[: requests_at(rate, args)],
                [rate],
                seed=args.seed,
                timeout_s=args.timeout_s,
                slos=slos,
                warmup=0 if i else 8,
                label=name,
                progress=sys.stderr.isatty(),
                echo=False,
            )
        )
        row["load_avg_1m_before"], row["load_avg_1m_after"] = load0, os.getloadavg()[0]
        rows.append(row)
        s = row["summary"]
        print(
            f"  {row['rate']:>5g} req/s: {s['completed']}/{s['requests']} done, {s['output_throughput']:.1f} out tok/s, "
            f"e2e p50 {s['e2e_ms']['p50'] or 0:.0f} ms, load {row['load_avg_1m_after']:.1f}",
            flush=True,
        )
    return rows


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slos = parse_slos(args.goodput)
    most = max(requests_at(rate, args) for rate in parse_rates(args.rates))
    requests = variance_requests(most, args.input_len, args.mean_output, args.cap, "chat", args.seed)
    started, by_system = time.perf_counter(), {}
    ours = [s for s in systems if s != "peer"]
    if ours:
        from ray import serve

        with local_serve(num_cpus=os.cpu_count(), logging_level="ERROR") as server:
            for mode in ours:
                url = server.deploy(mode, app_config(args, mode))
                by_system[mode] = run_sweep(mode, Target(url), requests, args, slos)
                serve.delete(mode)
    if "peer" in systems:
        from batcher.model_files import embedded_model_dir

        model_dir = str(embedded_model_dir()) if args.model == EMBEDDED_MODEL else args.model
        with peer_server(model_dir, args.peer_port or free_port(), out / "peer.log", args.peer_start_timeout_s) as url:
            target = Target(url, model=model_dir, ignore_eos_as="generation_config")
            by_system["peer"] = run_sweep("peer", target, requests, args, slos)
    if "llamacpp" in systems and args.model != EMBEDDED_MODEL:
        print(f"\n== llamacpp: skipped (it serves the embedded model's GGUF, not {args.model})", flush=True)
    elif "llamacpp" in systems:
        from load_tests.llamacpp_server import llamacpp_server

        # An HTTP thread per connection it may hold at once (every request of the longest sweep).
        with llamacpp_server(
            free_port(),
            out / "llamacpp.log",
            threads=args.threads,
            slots=args.max_num_seqs,
            http_threads=most + 16,
            start_timeout_s=args.peer_start_timeout_s,
        ) as url:
            by_system["llamacpp"] = run_sweep("llamacpp", Target(url), requests, args, slos)
    from load_tests.occupancy import occupancy_pair

    print("\n== occupancy traces (in-process engine, static then continuous)", flush=True)
    occupancy = occupancy_pair(
        args.model, args.occupancy_requests, args.occupancy_slots, seed=args.seed, threads=args.threads
    )
    result = write_report(out, args, by_system, occupancy, slos, time.perf_counter() - started)
    print(f"\nwrote {out}/index.html, its PNGs and {out}/experiment.json ({result['total_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
