"""`python -m cluster.burst --address HOST:PORT`: the autoscaling scenario on a running cluster
(and `replay_arrivals`, the open-loop trace replay cluster.sim_check drives real Serve with).

Deploys simulated replicas (sim:cpu-smollm2: the real engine and Serve plumbing, forward replaced by
sleeping) with the queue-depth policy, min 1 / max N replicas, then over HTTP (streaming completions):
1. burst: `--clients` closed-loop clients until N replicas run (the time it took is reported), and 10 s more;
2. tail: the burst clients finish their current request and stop; one client keeps a light load
   (a user reading each answer for THINK_S) while replicas return to the minimum (so replicas leave
   with streams in flight);
3. every request is counted: sent, answered in full (all tokens, then [DONE]), failed (with why).
Prints one JSON object; shuts down the Serve it started there and leaves the cluster running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from typing import List, Optional

import httpx
import numpy as np

from cluster.local_serve import local_serve

MAX_TOKENS = 32
# The tail client's pause between requests. Without one it sends ~0.5 req/s, where the policy's
# sizing (Poisson arrivals, the 1 s SLO) turns from one replica to two: at 0.37 req/s when a full
# replica does 1.35 req/s, 0.52 at 1.75 (both measured here), so whether the fleet got back to one hung
# on the machine's pace. With it, ~0.17 req/s: one replica even at 0.8 req/s a replica.
THINK_S = 4.0


def app_config(max_replicas: int, slo_s: float = 1.0, startup_s: float = 10.0) -> dict:
    return {
        "engine": {"model": "sim:cpu-smollm2", "max_num_seqs": 4, "max_model_len": 512},
        "served_model_name": "sim",
        # Ray's SPREAD is best effort: on a loaded machine it once put all four on the head node.
        "replica": {"num_cpus": 0, "max_ongoing_requests": 4, "max_queued_requests": -1, "max_replicas_per_node": 2},
        "ingress": {"num_cpus": 0},
        "autoscaling": {
            "min_replicas": 1,
            "max_replicas": max_replicas,
            "metrics_interval_s": 0.5,
            "policy_kwargs": {"slo_s": slo_s, "startup_s": startup_s},
        },
    }


class BurstTraffic:
    def __init__(self, url: str):
        self.url, self.counts, self.errors = url, Counter(), Counter()
        self.stop_burst = self.stop_tail = False

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        self.counts["sent"] += 1
        body = {
            "model": "sim",
            "prompt": f"request {i}: tell me a story",
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            tokens, done = 0, False
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.errors[f"http {resp.status_code}"] += 1
                    return
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        usage = json.loads(line[6:]).get("usage")  # the last chunk, before [DONE]
                        tokens = usage["completion_tokens"] if usage else tokens
            if done and tokens >= MAX_TOKENS:
                self.counts["ok"] += 1
            else:
                self.errors[f"incomplete ({tokens} tokens, done={done})"] += 1
        except Exception as e:  # counted, never raised: the point is to count every request
            self.errors[type(e).__name__] += 1

    async def client(self, client: httpx.AsyncClient, ident: int, tail: bool) -> None:
        n = 0
        # A closed client (the scenario ended, maybe on an error) fails at once: stop, don't spin.
        while not (self.stop_tail if tail else self.stop_burst) and not client.is_closed:
            await self.one(client, ident * 100000 + n)
            n += 1
            if tail:
                await asyncio.sleep(THINK_S)


def replica_states(app: str) -> tuple:
    """(running, starting, stopping) replicas of LLMServer, from Serve's status."""
    from ray import serve

    status = serve.status().applications.get(app)
    dep = status.deployments.get("LLMServer") if status else None
    states = dep.replica_states if dep else {}
    return states.get("RUNNING", 0), states.get("STARTING", 0), states.get("STOPPING", 0)


async def timed_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion: seconds to the first token (None if none came), prompt tokens, ok."""
    body = {
        "model": "sim",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    sent, out = time.monotonic(), {"ttft_s": None, "prompt_tokens": None, "ok": False, "latency_s": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out["error"] = f"http {resp.status_code}"
                return out
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    out["ok"], out["latency_s"] = True, time.monotonic() - sent
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if out["ttft_s"] is None and any(c.get("text") for c in chunk.get("choices") or []):
                        out["ttft_s"] = time.monotonic() - sent
                    if chunk.get("usage"):
                        out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
    except Exception as e:  # counted, never raised: every request of the trace is accounted for
        out["error"] = type(e).__name__
    return out


async def replay_arrivals(
    url: str, app: str, arrivals_s, prompts, max_tokens: int, until_s: float, sample_every_s: float = 0.5
) -> dict:
    """Sends prompts[i] at arrivals_s[i] (seconds from now, open loop) and samples the replica states
    every sample_every_s until until_s and every request has ended."""
    samples, t0, t0_wall = [], time.monotonic(), time.time()

    async def at(i: int, client: httpx.AsyncClient) -> dict:
        await asyncio.sleep(max(0.0, t0 + arrivals_s[i] - time.monotonic()))
        return await timed_request(client, url, prompts[i], max_tokens)

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        tasks = [asyncio.create_task(at(i, client)) for i in range(len(prompts))]
        try:
            while time.monotonic() - t0 < until_s or not all(t.done() for t in tasks):
                states = await asyncio.to_thread(replica_states, app)  # off the loop: TTFTs stay exact
                samples.append((time.monotonic() - t0, *states))
                await asyncio.sleep(sample_every_s)
        finally:  # on any error too: no request outlives the replay
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "samples": samples,
        "t0_wall": t0_wall,
        "requests": [
            r if isinstance(r, dict) else {"ttft_s": None, "ok": False, "error": type(r).__name__} for r in results
        ],
    }


def startup_from(samples: List[tuple], default: float) -> tuple:
    """Seconds from the ask for each new replica (starting + running rising past k) to k running, one
    per replica: (median, count, all); (default, 0, []) when none completed. Replicas asked together
    land one by one (they start on shared cores), so their median is what a simulator that lands a
    replica start-up seconds after its ask should take. Samples: (t, running, starting)."""
    delays, asked_prev = [], samples[0][1] + samples[0][2] if samples else 0
    for k, (t, running, starting) in enumerate(samples):
        asked = running + starting
        for n in range(max(asked_prev, running) + 1, asked + 1):
            done = next((s[0] for s in samples[k:] if s[1] >= n), None)
            cut = next((s[0] for s in samples[k:] if s[1] + s[2] < n), None)  # the ask was withdrawn
            if done is not None and (cut is None or cut > done):
                delays.append(round(done - t, 2))
        asked_prev = asked
    return (float(np.median(delays)), len(delays), delays) if delays else (default, 0, [])


def full_step_s(reqs: List[dict], slo_s: float, max_tokens: int) -> Optional[float]:
    """Median seconds per decoded token of requests that queued (TTFT past the SLO: they ran in a
    full replica), i.e. a full replica's step time as measured; None without such requests."""
    per = [
        (r["latency_s"] - r["ttft_s"]) / (max_tokens - 1)
        for r in reqs
        if r["ok"] and r.get("latency_s") and r["ttft_s"] is not None and r["ttft_s"] > slo_s
    ]
    return float(np.median(per)) if per and max_tokens > 1 else None


async def serve_replay(app: dict, arrivals_s, prompts, max_tokens: int, until_s: float) -> dict:
    """`app` on a local Serve (started and stopped here): one request (the app answers; it is slow,
    seconds, on a fresh app: more warm-up makes a policy scale and remember it before the replay),
    then replay_arrivals; its result with `warm_up_s`."""
    from ray import serve

    from deployments.app import build_app

    name = "replay"
    with local_serve(logging_level="ERROR") as server:
        serve.run(build_app(app), name=name, route_prefix="/")
        ready = await replay_arrivals(server.url, name, [0.0], ["warm-up"], max_tokens, 0.0)
        if not ready["requests"][0]["ok"]:
            raise RuntimeError(f"the app does not answer: {ready['requests'][0]}")
        got = await replay_arrivals(server.url, name, arrivals_s, prompts, max_tokens, until_s)
    return {**got, "warm_up_s": ready["requests"][0]["latency_s"]}


def replicas(app: str) -> tuple:
    """(running replicas of LLMServer, running or starting ones, node ids hosting one)."""
    import ray
    from ray.util.state import list_actors

    running, starting, _ = replica_states(app)
    # This cluster's address, not auto-detection (which refuses when another Ray runs on the machine).
    address = ray.get_runtime_context().gcs_address
    nodes = {
        a.node_id
        for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
        if a.class_name == f"ServeReplica:{app}:LLMServer"
    }
    return running, running + starting, nodes


async def scenario(
    url: str, app: str, clients: int, max_replicas: int, up_timeout_s: float, down_timeout_s: float
) -> dict:
    load, out = BurstTraffic(url), {"timeline": []}
    t0 = time.time()
    nodes_seen: set = set()

    def sample() -> tuple:
        n, asked, nodes = replicas(app)
        nodes_seen.update(nodes)
        out["timeline"].append([round(time.time() - t0, 1), n])
        return n, asked

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
        await load.one(http, -1)  # warm: the app answers
        if load.counts["ok"] != 1:
            raise RuntimeError(f"the app does not answer: {dict(load.errors)}")
        burst = [asyncio.create_task(load.client(http, i, tail=False)) for i in range(clients)]
        tail = asyncio.create_task(load.client(http, clients, tail=True))
        try:
            await _scale_up_then_down(load, out, sample, burst, tail, max_replicas, up_timeout_s, down_timeout_s)
        finally:  # on any error too: no client may outlive the scenario
            load.stop_burst = load.stop_tail = True
            for task in (*burst, tail):
                task.cancel()
            await asyncio.gather(*burst, tail, return_exceptions=True)
    out.update(
        sent=load.counts["sent"],
        ok=load.counts["ok"],
        failed=sum(load.errors.values()),
        errors=dict(load.errors),
        nodes_with_replicas=len(nodes_seen),
    )
    return out


async def _scale_up_then_down(
    load: BurstTraffic, out: dict, sample, burst, tail, max_replicas: int, up_timeout_s: float, down_timeout_s: float
) -> None:
    """Burst until max_replicas run, then the light tail until replicas are back to one.
    `seconds_to_max`: until they run; `seconds_to_ask_max`: until Serve was starting them all (the
    policy's decision; the rest is the replicas' start-up, slow on a busy machine)."""
    t_burst, asked_at = time.time(), None
    while time.time() - t_burst < up_timeout_s:
        running, asked = sample()
        if asked >= max_replicas and asked_at is None:
            asked_at = time.time()
        if running >= max_replicas:
            break
        await asyncio.sleep(0.5)
    out["seconds_to_max"] = round(time.time() - t_burst, 1) if out["timeline"][-1][1] >= max_replicas else None
    out["seconds_to_ask_max"] = None if asked_at is None else round(asked_at - t_burst, 1)
    out["max_replicas_seen"] = max(n for _, n in out["timeline"])
    await asyncio.sleep(10)  # the burst goes on a little at full size (and sends enough to count)
    load.stop_burst = True
    await asyncio.gather(*burst)
    t_down = time.time()
    while time.time() - t_down < down_timeout_s and sample()[0] > 1:
        await asyncio.sleep(0.5)
    out["seconds_to_min"] = round(time.time() - t_down, 1) if out["timeline"][-1][1] <= 1 else None
    load.stop_tail = True
    await tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="GCS address of the cluster (cluster.local up prints it)")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--up-timeout-s", type=float, default=90)
    ap.add_argument("--down-timeout-s", type=float, default=120)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # cluster.local's clusters run without tokens

    from ray import serve

    from deployments.app import build_app

    app = "burst"
    # The cluster named by --address (never one found on the machine); Serve's proxy on the head only.
    with local_serve(address=args.address, proxy_location="HeadOnly", logging_level="ERROR") as server:
        serve.run(build_app(app_config(args.max_replicas)), name=app, route_prefix="/")
        result = asyncio.run(
            scenario(server.url, app, args.clients, args.max_replicas, args.up_timeout_s, args.down_timeout_s)
        )
        result.update(max_replicas=args.max_replicas, clients=args.clients)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
