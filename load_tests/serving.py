"""`python -m load_tests.serving`: what the serving path costs, measured in one run.

The same workload goes (1) through the in-process AsyncLLMEngine and (2) through HTTP -> Serve
proxy -> ingress -> LLM replica (the app of serve_config.yaml, one replica, same engine settings),
for each torch thread count asked (default: 2, as serve_config.yaml, then 1), in two regimes:
- saturated: every request at t=0 (prompts of random token ids, capped-exponential output
  lengths, EOS ignored); output tokens/s over the whole run;
- light: one request at a time, alternating between the two paths so that drift on a shared
  machine hits both alike; time to first token (TTFT).
Targets: saturated HTTP throughput >= 90% of in-process; TTFT added by the stack <= 25 ms at p50.
Then the same cores two ways over HTTP, under a burst of N x the requests: N one-thread replicas
against one N-thread replica (serve_config.yaml).
Bounded: a fixed number of requests per phase and a wall-clock cap per phase.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Awaitable, Callable, List, Optional, Sequence, Tuple

from load_tests.serving_report import report, report_layouts
from load_tests.workload import capped_lengths, exponential_draws, random_prompts

APP = "bench"
Request = Tuple[List[int], int]  # prompt token ids, max_tokens
Timing = Tuple[float, float, int]  # TTFT s, end-to-end s, output tokens


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.serving", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=64, help="saturated phase: requests sent at t=0")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--mean-output", type=float, default=48.0)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--light-requests", type=int, default=20, help="light phase: sequential requests")
    p.add_argument("--light-output", type=int, default=4)
    p.add_argument("--threads", default="2,1",
                   help="torch threads of the engine, comma separated: one in-process/HTTP pair each")
    p.add_argument("--data-parallel", type=int, default=2,
                   help="then compare N 1-thread replicas with 1 N-thread replica over HTTP; 0 = skip")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--stream-interval-ms", type=float, default=20.0)
    p.add_argument("--max-chunks-per-s", type=float, default=100.0, help="replica chunk budget; 0 = none")
    p.add_argument("--phase-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/serving.json")
    return p.parse_args(argv)


def engine_config(args) -> dict:
    return {"model": args.model, "device": "cpu", "dtype": "float32", "num_threads": args.threads,
            "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False}


def workload(args, vocab: Tuple[int, int]) -> Tuple[List[Request], List[Request], List[Request]]:
    n = args.num_requests
    prompts = random_prompts(n + args.light_requests + 4, args.prompt_len, vocab, args.seed)
    lengths = capped_lengths(exponential_draws(n, args.mean_output, args.seed), args.max_output)
    saturated = list(zip(prompts[:n], lengths))
    light = [(p, args.light_output) for p in prompts[n:n + args.light_requests]]
    warmup = [(p, 8) for p in prompts[-4:]]
    return saturated, light, warmup


# ---- the two paths: each sends one request and times it ---------------------------------------

def in_process_sender(engine) -> Callable[[Request], Awaitable[Timing]]:
    from batcher import SamplingParams

    async def send(req: Request) -> Timing:
        t0, ttft, n = time.perf_counter(), None, 0
        params = SamplingParams(max_tokens=req[1], temperature=0.0, ignore_eos=True)
        async for delta in engine.stream(list(req[0]), params):
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            n += len(delta.token_ids)
        return ttft, time.perf_counter() - t0, n

    return send


def http_sender(client, url: str) -> Callable[[Request], Awaitable[Timing]]:
    async def send(req: Request) -> Timing:
        body = {"prompt": list(req[0]), "max_tokens": req[1], "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0, ttft, n = time.perf_counter(), None, 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ttft = ttft if ttft is not None else time.perf_counter() - t0  # first event: first token
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    n = usage["completion_tokens"]
        return ttft, time.perf_counter() - t0, n

    return send


_RAY_DAEMONS = ("raylet", "gcs_server")


def cpu_seconds() -> dict:
    """CPU seconds so far of this process and of every Ray process, by role (proctitle)."""
    import psutil

    out = {"client (this process)": sum(psutil.Process().cpu_times()[:2])}
    for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        role = cmd.split()[0][5:] if cmd.startswith("ray::") else proc.info["name"]
        if proc.pid != os.getpid() and role in _RAY_DAEMONS or cmd.startswith("ray::"):
            out[role] = out.get(role, 0.0) + sum(proc.info["cpu_times"][:2])
    return out


async def saturate(send, saturated: List[Request], warmup: List[Request], timeout_s: float) -> dict:
    """Every request at t=0; output tokens/s over the whole burst, and each process's CPU seconds."""
    for req in warmup:
        await send(req)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    sat = await asyncio.wait_for(asyncio.gather(*(send(r) for r in saturated)), timeout_s)
    wall = time.perf_counter() - t0
    cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu_seconds().items() if v - cpu0.get(k, 0.0) > 0.05}
    out_tokens = sum(t[2] for t in sat)
    expected = sum(r[1] for r in saturated)
    assert out_tokens == expected, f"generated {out_tokens} tokens, expected {expected}"
    return {"requests": len(sat), "output_tokens": out_tokens, "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
            **_pcts("ttft_ms", [t[0] for t in sat]), **_pcts("e2e_ms", [t[1] for t in sat]),
            "cpu_seconds_by_process": cpu}


async def one_at_a_time(sends: Sequence[Callable[[Request], Awaitable[Timing]]], light: List[Request],
                        timeout_s: float) -> List[dict]:
    """Light load: one request in flight. With several paths the requests alternate between them,
    so drift on a shared machine hits every path alike."""
    timings: List[List[Timing]] = [[] for _ in sends]
    for req in light:
        for send, out in zip(sends, timings):
            out.append(await asyncio.wait_for(send(req), timeout_s))
    return [{"requests": len(t), **_pcts("ttft_ms", [x[0] for x in t]), **_pcts("e2e_ms", [x[1] for x in t])}
            for t in timings]


def _pcts(name: str, seconds: List[float]) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    q = lambda p: ms[min(len(ms) - 1, int(p * len(ms)))]  # noqa: E731
    return {f"{name}_p50": statistics.median(ms), f"{name}_p90": q(0.9), f"{name}_max": ms[-1]}


# ---- phases ----------------------------------------------------------------------------------

@contextlib.contextmanager
def serve_app(args, replicas: int = 1):
    """A local Ray cluster running the app (one ingress, `replicas` LLM replicas); yields its URL."""
    import ray
    from ray import serve

    from deployments.app import build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, replicas), include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stream = {"interval_ms": args.stream_interval_ms, "max_chunks_per_s": args.max_chunks_per_s or None}
        replica = {"max_ongoing_requests": max(128, args.num_requests), "num_replicas": replicas,
                   "num_cpus": 1 if replicas > 1 else 0}  # side by side: one core each
        serve.run(build_app({"engine": engine_config(args), "stream": stream, "replica": replica}),
                  name=APP, route_prefix=f"/{APP}")
        yield f"http://127.0.0.1:{port}/{APP}"
    finally:
        serve.shutdown()
        ray.shutdown()


def http_client(args):
    import httpx

    limits = httpx.Limits(max_connections=2 * args.num_requests + 8)
    return httpx.AsyncClient(timeout=args.phase_timeout_s, limits=limits)


def bench_pair(args, saturated, light, warmup) -> Tuple[dict, dict]:
    """The in-process engine, then the same engine settings behind Serve; light requests alternate
    between the two (the in-process engine idles while Serve is saturated)."""
    from batcher import AsyncLLMEngine, EngineConfig

    engine = AsyncLLMEngine(EngineConfig(**engine_config(args)))
    try:
        local = in_process_sender(engine)
        inproc = {"saturated": asyncio.run(saturate(local, saturated, warmup, args.phase_timeout_s))}
        print("HTTP -> proxy -> ingress -> replica...", flush=True)
        with serve_app(args) as url:
            async def go():
                async with http_client(args) as client:
                    remote = http_sender(client, url)
                    sat = await saturate(remote, saturated, warmup, args.phase_timeout_s)
                    lite_local, lite_remote = await one_at_a_time([local, remote], light, args.phase_timeout_s)
                    return {"saturated": sat, "light": lite_remote}, lite_local

            http, inproc["light"] = asyncio.run(go())
        return inproc, http
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def bench_layout(args, saturated, light, warmup, replicas: int) -> dict:
    """HTTP only: `replicas` LLM replicas of args.threads torch threads each."""
    with serve_app(args, replicas) as url:
        async def go():
            async with http_client(args) as client:
                send = http_sender(client, url)
                sat = await saturate(send, saturated, warmup, args.phase_timeout_s)
                (lite,) = await one_at_a_time([send], light, args.phase_timeout_s)
                return {"saturated": sat, "light": lite}

        return asyncio.run(go())


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    from batcher.model_loader import load_tokenizer
    from load_tests.workload import text_token_range

    vocab = text_token_range(load_tokenizer(args.model))
    saturated, light, warmup = workload(args, vocab)
    print(f"workload: {len(saturated)} saturated requests ({args.prompt_len} prompt tokens, "
          f"{sum(r[1] for r in saturated)} output tokens), {len(light)} light requests; model {args.model}")
    started, runs, layouts = time.perf_counter(), [], []
    for threads in [int(t) for t in str(args.threads).split(",") if t]:
        run_args = argparse.Namespace(**{**vars(args), "threads": threads})
        print(f"\n== engine with {threads} torch thread(s): in-process engine...", flush=True)
        inproc, http = bench_pair(run_args, saturated, light, warmup)
        print(f"\n-- {threads} torch thread(s)")
        runs.append({"threads": threads, "in_process": inproc, "http": http, "targets": report(inproc, http)})
    if args.data_parallel > 1:
        # Same cores two ways, under a burst that fills every replica's batch.
        n = args.data_parallel
        burst_args = argparse.Namespace(**{**vars(args), "num_requests": n * args.num_requests})
        burst = workload(burst_args, vocab)[0]
        for replicas, threads in ((n, 1), (1, n)):
            layout = f"{replicas} replica(s) x {threads} thread(s)"
            print(f"\n== {layout}, HTTP, {len(burst)} requests at t=0...", flush=True)
            run_args = argparse.Namespace(**{**vars(burst_args), "threads": threads})
            layouts.append({"layout": layout, "replicas": replicas, "threads": threads,
                            "http": bench_layout(run_args, burst, light, warmup, replicas)})
        report_layouts(layouts, len(burst))
    result = {
        "benchmark": "serving", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": vars(args), "runs": runs, "layouts": layouts, "total_seconds": time.perf_counter() - started,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json} ({result['total_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
