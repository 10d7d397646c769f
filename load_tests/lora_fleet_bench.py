"""`python -m load_tests.lora_fleet_bench`: K LoRA adapters on one multiplexed fleet against one
deployment per adapter (what plain Serve users do today), the same requests, one run.

For each K in --adapters (default 1, 8, 32), back to back on one local Ray cluster:
- multiplexed: ONE app, --replicas replicas, `engine.lora.adapters` = all K adapters
  (max_loras = min(K, 8), max_cpu_loras = K): a batch mixes adapters in one forward;
- per-adapter: K apps (each its own ingress and one LLM replica) with `engine.lora.adapters` = its
  adapter alone; requests for adapter i go to app i.
The same CPU budget for both ("on the same replicas" on a small machine): --cpus torch threads in
all, split over the replicas; the multiplexed fleet's R replicas get cpus // R threads each, the
per-adapter fleet's K replicas max(1, cpus // K) each, so at K > cpus they contend for the cores as
K single-core deployments packed on one machine would. Ray reserves no CPUs for either (replica
num_cpus 0), so both fit the same node. Per-adapter fleets run only up to --per-adapter-max-k
(default 8): 32 replicas and 32 ingresses, each process a model copy plus Ray's overhead, do not fit
a 24 GiB, 2-core machine; the table says when a K was skipped.
Adapters: --adapters-max random PEFT adapters (rank --rank on every decoder linear layer, made with
`peft` as load_tests.lora_step_bench makes them) in a temporary directory.
Requests: --num-requests chat requests per K (short random-word prompts), adapter i mod K for request i,
`model` = `<base>:<adapter>`, greedy, EOS ignored, exactly --max-tokens tokens each; a closed loop of
--concurrency requests in flight over the whole fleet (the same client load for both systems). Each
system first gets an unmeasured warm-up wave of max(K, --concurrency) such requests (every adapter
loaded, the batch sizes of the run seen once: eager CPU forwards are slow on a shape's first use). Reports per system and K: requests, failures, output tokens/s, TTFT p50/p90, output
tokens per CPU second of the fleet's replicas and ingresses (what other users of a shared machine do
not change: there, K per-adapter processes get a larger share of the cores than one replica's threads,
which flatters per-adapter wall-clock throughput; run alone for figures), the ratios multiplexed /
per-adapter, and how many greedy answers agree between the two (the same weights; bf16 on other
thread counts and batches may differ in a few). Target (issue 23): the
multiplexed fleet >= 2x the per-adapter throughput at K = 8. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from load_tests.bench_client import BenchRecord, BenchRequest, Target, send_one
from load_tests.bench_metrics import summarize

SYSTEMS = ("multiplexed", "per-adapter")
MAX_SLOTS = 8  # max_loras of the multiplexed fleet: min(K, this)
_WORDS = (
    "data model serve token cache route replica batch queue stream system user answer engine "
    "prompt prefix block memory latency request cluster policy scale shard node tensor"
).split()

# A request of the workload: the adapter it names, and the request.
Work = List[Tuple[str, BenchRequest]]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.lora_fleet_bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapters", default="1,8,32", help="adapter counts K, comma separated")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument(
        "--per-adapter-max-k",
        type=int,
        default=8,
        help="per-adapter fleets only up to this K (one replica and one ingress per adapter)",
    )
    p.add_argument("--replicas", type=int, default=1, help="replicas of the multiplexed fleet")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="torch threads of each fleet in all")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=96, help="per K, adapters round-robin")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight over the whole fleet")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="per replica (8 tokens each)")
    p.add_argument(
        "--adapters-dir",
        default=None,
        help="reuse adapters a0..aN-1 from here (made there if missing); default: a temporary directory",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/lora_fleet_bench.json")
    args = p.parse_args(argv)
    args.adapters = [int(k) for k in str(args.adapters).split(",") if k]
    args.systems = [s for s in str(args.systems).split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.adapters or min(args.adapters) < 1:
        p.error(f"--systems from {SYSTEMS}; --adapters positive counts")
    return args


def adapter_paths(args, directory: Path) -> Dict[str, str]:
    """a0..a{max K - 1}, made with peft unless `directory` already holds them."""
    from load_tests.lora_step_bench import make_adapters

    count = max(args.adapters)
    names = [f"a{i}" for i in range(count)]
    if all((directory / n / "adapter_config.json").exists() for n in names):
        return {n: str(directory / n) for n in names}
    return make_adapters(args.model, count, args.rank, directory)


def app_config(args, adapters: Dict[str, str], threads: int) -> dict:
    """One app: one replica's engine serving `adapters` on `threads` torch threads."""
    lora = {
        "adapters": adapters,
        "max_loras": min(len(adapters), MAX_SLOTS),
        "max_cpu_loras": len(adapters),
        "max_lora_rank": args.rank,
    }
    return {
        "engine": {
            "model": args.model,
            "dtype": args.dtype,
            "num_threads": threads,
            "max_num_seqs": max(64, args.concurrency),
            "num_kv_blocks": args.num_kv_blocks,
            "lora": lora,
        },
        "replica": {"num_replicas": 1, "num_cpus": 0, "max_ongoing_requests": max(128, args.concurrency)},
        "stream": {"interval_ms": 20},
        "router": {"request_router_class": "router:LLMRouter", "request_routing_stats_period_s": 0.5},
    }


def fleets(args, paths: Dict[str, str], k: int) -> Dict[str, Dict[str, dict]]:
    """system -> {app name: AppConfig dict} for K = k; each app serves the adapters its config lists."""
    names = list(paths)[:k]
    out: Dict[str, Dict[str, dict]] = {}
    if "multiplexed" in args.systems:
        cfg = app_config(args, {n: paths[n] for n in names}, max(1, args.cpus // args.replicas))
        cfg["replica"]["num_replicas"] = args.replicas
        out["multiplexed"] = {f"mux{k}": cfg}
    if "per-adapter" in args.systems and k <= args.per_adapter_max_k:
        threads = max(1, args.cpus // k)
        out["per-adapter"] = {f"k{k}{n}": app_config(args, {n: paths[n]}, threads) for n in names}
    return out


def workload(args, k: int, n: int, max_tokens: int, salt: str = "") -> Work:
    """n chat requests, request i on adapter a{i mod k}; the same for every system at this k."""
    rng = random.Random(f"{args.seed}:{k}:{salt}")
    return [
        (
            f"a{i % k}",
            BenchRequest(
                messages=[
                    {
                        "role": "user",
                        "content": f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(args.prompt_words)),
                    }
                ],
                max_tokens=max_tokens,
                ignore_eos=True,
            ),
        )
        for i in range(n)
    ]


async def drive(
    routes: Dict[str, Tuple[Target, str]], work: Work, concurrency: int, timeout_s: float
) -> Tuple[List[BenchRecord], float]:
    """Sends `work` as a closed loop of `concurrency` requests in flight; a request on adapter X goes
    to routes[X] = (its app, the `model` it names). Returns the records (in work order) and the wall time."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    records = [BenchRecord(index=i) for i in range(len(work))]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0), limits=httpx.Limits(max_connections=concurrency + 8)
    ) as client:

        async def one(i: int) -> None:
            adapter, req = work[i]
            target, model = routes[adapter]
            async with gate:
                record = records[i]
                record.start_s = time.perf_counter() - t0
                try:
                    record.output_text = await asyncio.wait_for(
                        send_one(client, target, model, req.messages, req.max_tokens, req.ignore_eos, record, t0),
                        timeout_s,
                    )
                except asyncio.TimeoutError:
                    record.error = f"timeout after {timeout_s:g} s"
                except Exception as e:  # a refused connection, a broken stream: a failure, not a crash
                    record.error = f"{type(e).__name__}: {e}"[:500]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(work))))
        return records, time.perf_counter() - t0


def fleet_cpu_seconds(apps: Sequence[str]) -> float:
    """CPU seconds so far of the replicas (LLM servers and ingresses) of `apps`, found by their process
    titles (`ray::ServeReplica:<app>:<deployment>`): a fleet's cost that other users of a shared
    machine do not change, unlike its wall time."""
    import psutil

    prefixes = tuple(f"ray::ServeReplica:{app}:" for app in apps)
    total = 0.0
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith(prefixes) and proc.info["cpu_times"]:
            total += sum(proc.info["cpu_times"][:2])
    return total


def run_system(
    base_url: str, apps: Dict[str, object], configs: Dict[str, dict], work: Work, warmup: Work, args
) -> dict:
    """Deploys the system's apps, warms them up, measures `work`, deletes them."""
    from ray import serve
    from ray.serve import RunTarget

    t0 = time.perf_counter()
    serve.run_many([RunTarget(target=apps[name], name=name, route_prefix=f"/{name}") for name in configs])
    started_s = time.perf_counter() - t0
    routes = {
        adapter: (Target(f"{base_url}/{name}"), f"{args.model}:{adapter}")
        for name, cfg in configs.items()
        for adapter in cfg["engine"]["lora"]["adapters"]
    }
    try:
        records, _ = asyncio.run(drive(routes, warmup, args.concurrency, args.timeout_s))
        failed = [r for r in records if not r.ok]
        if failed:
            raise RuntimeError(
                f"warm-up: {len(failed)} of {len(records)} requests failed, first: "
                f"status {failed[0].status}: {failed[0].error}"
            )
        cpu0 = fleet_cpu_seconds(list(configs))
        records, wall = asyncio.run(drive(routes, work, args.concurrency, args.timeout_s))
        cpu = fleet_cpu_seconds(list(configs)) - cpu0
    finally:
        for name in configs:
            serve.delete(name)
    s = summarize(records, wall)
    return {
        "apps": len(configs),
        "replicas": sum(c["replica"]["num_replicas"] for c in configs.values()),
        "threads_per_replica": next(iter(configs.values()))["engine"]["num_threads"],
        "start_s": started_s,
        "requests": s["requests"],
        "failed": s["failed"],
        "output_tokens": s["output_tokens"],
        "wall_s": wall,
        "output_tokens_per_s": s["output_throughput"],
        "fleet_cpu_s": cpu,
        "output_tokens_per_cpu_s": s["output_tokens"] / max(cpu, 1e-9),
        "ttft_ms_p50": s["ttft_ms"]["p50"],
        "ttft_ms_p90": s["ttft_ms"]["p90"],
        "tpot_ms_p50": s["tpot_ms"]["p50"],
        "failures": s["failures"][:5],
        "answers": [r.output_text for r in records],
    }


def compare(by_system: Dict[str, dict]) -> dict:
    """Multiplexed over per-adapter at one K: throughput ratio, greedy answers that agree."""
    mux, per = by_system.get("multiplexed"), by_system.get("per-adapter")
    if not mux or not per:
        return {}
    same = sum(a is not None and a == b for a, b in zip(mux["answers"], per["answers"]))
    return {
        "throughput_ratio": mux["output_tokens_per_s"] / max(per["output_tokens_per_s"], 1e-9),
        "per_cpu_s_ratio": mux["output_tokens_per_cpu_s"] / max(per["output_tokens_per_cpu_s"], 1e-9),
        "ttft_p50_ratio": (mux["ttft_ms_p50"] or 0) / max(per["ttft_ms_p50"] or 0, 1e-9),
        "answers_equal": same,
        "answers": len(mux["answers"]),
    }


def report(args, results: Dict[int, dict]) -> List[dict]:
    print(
        f"\nmodel {args.model} ({args.dtype}), adapters of rank {args.rank}; {args.num_requests} requests per K x "
        f"{args.max_tokens} tokens, greedy, {args.concurrency} in flight; {args.cpus} torch threads per fleet"
    )
    print(
        f"{'K':>3} {'system':12} {'apps':>4} {'repl.':>5} {'thr.':>4} {'done':>5} {'fail':>4} {'out tok/s':>9} "
        f"{'TTFT p50':>9} {'TTFT p90':>9} {'tok/CPU s':>9} {'start s':>7}"
    )
    checks = []
    for k, res in results.items():
        for system in args.systems:
            m = res["systems"].get(system)
            if m is None:
                print(
                    f"{k:>3} {system:12} skipped (K > --per-adapter-max-k {args.per_adapter_max_k}: "
                    f"{k} replicas + {k} ingresses do not fit this machine)"
                )
                continue
            print(
                f"{k:>3} {system:12} {m['apps']:>4} {m['replicas']:>5} {m['threads_per_replica']:>4} "
                f"{m['requests'] - m['failed']:>5} {m['failed']:>4} {m['output_tokens_per_s']:>9.1f} "
                f"{m['ttft_ms_p50'] or 0:>7.0f}ms {m['ttft_ms_p90'] or 0:>7.0f}ms {m['output_tokens_per_cpu_s']:>9.1f} "
                f"{m['start_s']:>7.0f}"
            )
        c = res["comparison"]
        if c:
            print(
                f"{k:>3} {'mux / per':12} throughput x{c['throughput_ratio']:.2f}, tokens per CPU s "
                f"x{c['per_cpu_s_ratio']:.2f}, TTFT p50 x{c['ttft_p50_ratio']:.2f}, "
                f"greedy answers equal {c['answers_equal']}/{c['answers']}"
            )
            if k == 8:
                checks.append(
                    {
                        "target": "multiplexed >= 2x per-adapter throughput at K=8",
                        "value": c["throughput_ratio"],
                        "met": c["throughput_ratio"] >= 2.0,
                    }
                )
    for c in checks:
        print(f"target: {c['target']}: x{c['value']:.2f} {'met' if c['met'] else 'MISSED'}")
    return checks


def main(argv: Optional[Sequence[str]] = None, server=None) -> dict:
    """`server`: a running cluster.local_serve.LocalServe to deploy on (tests); None: a local one of its own."""
    args = parse_args(argv)
    from cluster.local_serve import local_serve
    from deployments.app import build_app

    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lora_fleet_") as tmp:
        directory = Path(args.adapters_dir or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        paths = adapter_paths(args, directory)
        made_s = time.perf_counter() - started
        plan = {k: fleets(args, paths, k) for k in args.adapters}
        # Every app is built (its router class serialized) before a handle exists in this process (as
        # load_tests.routing does: serializing a router class after that failed).
        apps = {
            name: build_app(cfg)
            for by_system in plan.values()
            for configs in by_system.values()
            for name, cfg in configs.items()
        }
        print(f"{len(paths)} adapters ready in {made_s:.0f} s; load avg {os.getloadavg()[0]:.1f}", flush=True)
        results: Dict[int, dict] = {}
        with (
            contextlib.nullcontext(server)
            if server
            else local_serve(num_cpus=args.cpus, logging_level="ERROR") as server
        ):
            for k, by_system in plan.items():
                work = workload(args, k, args.num_requests, args.max_tokens)
                # A full wave: every adapter loaded, every batch size up to --concurrency seen once.
                warmup = workload(args, k, max(k, args.concurrency), args.max_tokens, salt="warmup")
                systems = {}
                for system, configs in by_system.items():
                    systems[system] = run_system(server.url, apps, configs, work, warmup, args)
                    m = systems[system]
                    print(
                        f"  K={k} {system}: {m['output_tokens_per_s']:.1f} out tok/s, TTFT p50 "
                        f"{m['ttft_ms_p50'] or 0:.0f} ms, {m['failed']} failed",
                        flush=True,
                    )
                results[k] = {"systems": systems, "comparison": compare(systems)}
    checks = report(args, results)
    out = {
        "benchmark": "lora_fleet",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
        "load_avg_1m": os.getloadavg()[0],
        "results": results,
        "targets": checks,
        "total_seconds": time.perf_counter() - started,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json} ({out['total_seconds']:.0f} s)")
    return out


if __name__ == "__main__":
    main()
