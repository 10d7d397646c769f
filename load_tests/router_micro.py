"""`python -m load_tests.router_micro`: LLMRouter's CPU per decision and per request, at 100+ replicas.

No Ray cluster: the router scores stand-ins for Serve's RunningReplica (an id and fresh routing
stats); every replica's prefix index holds a shared system prompt plus conversations of its own,
and this router has requests in flight on each. Times each request's whole way through the router,
each part as p50/p99 over many requests: the decision (`prepare`: hashing the prompt; `score`: index
lookups, load estimates, ranking; `claim`: its prefix claimed on its replica), Serve's confirmation
(`confirm`: the claim becomes cached blocks) and its answer (`answer`: prompt and answer cached).
In an ingress every part runs on its event loop: their sum is the CPU LLMRouter adds to each request
there (measured in one: docs/routing_results.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace
from typing import List, Optional, Sequence

from batcher.block_hash import cacheable_block_hashes, root_hash
from batcher.sampling_params import SamplingParams
from deployments.protocol import PreparedRequest

MODEL = "micro-model"  # the engine's model: the root of the block hashes


def make_router(block_size: int = 8):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.llm_router import LLMRouter

    router = LLMRouter(
        deployment_id=DeploymentID(name="LLMServer", app_name="micro"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    router.initialize_state(
        model=MODEL, block_size=block_size, max_num_batched_tokens=2048, max_num_seqs=64, cost_model="h100-llama3-8b"
    )
    return router


def fake_fleet(router, replicas: int, prompt_tokens: int, seed: int = 0) -> List[SimpleNamespace]:
    from ray.serve._private.common import DeploymentID, ReplicaID

    rng, now, root = random.Random(seed), time.time(), root_hash(MODEL)
    system = list(range(1000, 1000 + prompt_tokens // 2))
    fleet = []
    for i in range(replicas):
        rid = ReplicaID(unique_id=f"r{i}", deployment_id=DeploymentID(name="LLMServer", app_name="micro"))
        running = rng.randrange(64)
        fleet.append(
            SimpleNamespace(
                replica_id=rid,
                routing_stats={
                    "time_s": now - 0.2,
                    "waiting": rng.randrange(4),
                    "running": running,
                    "queued_prefill_tokens": rng.randrange(4096),
                    "context_tokens": running * 1500,
                    "kv_blocks_free": rng.randrange(50_000),
                    "kv_blocks_total": 50_000,
                },
            )
        )
        for c in range(20):  # conversations this replica holds
            router.index.insert(rid.unique_id, cacheable_block_hashes(system + [i, c] * (prompt_tokens // 4), 8, root))
        for k in range(8):  # requests this router sent it, not confirmed yet (their prefixes claimed there)
            ids = system + [i, 20 + k] * (prompt_tokens // 4)
            hashed = router.prepare(PreparedRequest(f"{i}-{k}", ids, SamplingParams(max_tokens=128)))
            router.ledger.chosen(f"{i}-{k}", rid.unique_id, hashed, prompt_tokens // 2, now - rng.random())
    return fleet


PARTS = ("prepare", "score", "claim", "confirm", "answer")  # a request's way through the router, in order
ANSWER = list(range(50_000, 50_064))  # every request's answer: 64 tokens, 8 more blocks cached


def time_requests(router, fleet, prompts: Sequence[Sequence[int]]) -> dict:
    """Seconds of each part (PARTS) for each prompt, sent through `router` one after the other:
    decided over `fleet`, confirmed on its first choice, ended there and answered."""
    seconds = {part: [] for part in PARTS}
    for d, ids in enumerate(prompts):
        request = PreparedRequest(f"micro-{d}", ids, SamplingParams(max_tokens=128))
        now = time.time()
        t = [time.perf_counter()]
        prepared = router.prepare(request)
        t.append(time.perf_counter())
        best = router.score(fleet, prepared)[0]
        t.append(time.perf_counter())
        router.ledger.chosen(request.request_id, best.replica, prepared, best.cached_tokens, now)
        t.append(time.perf_counter())
        router.ledger.routed(request.request_id, best.replica, None, now)
        t.append(time.perf_counter())
        router.ledger.completed_on(request.request_id, best.replica, now)
        router.record_answer(request.request_id, ids, ANSWER)
        t.append(time.perf_counter())
        for part, a, b in zip(PARTS, t, t[1:]):
            seconds[part].append(b - a)
    return seconds


def time_decisions(replicas: int, prompt_tokens: int, decisions: int) -> dict:
    router = make_router()
    fleet = fake_fleet(router, replicas, prompt_tokens)
    system = list(range(1000, 1000 + prompt_tokens // 2))
    seconds = time_requests(
        router, fleet, [system + [d % replicas, d % 20] * (prompt_tokens // 4) for d in range(decisions)]
    )

    def pcts(xs):
        xs = sorted(x * 1e6 for x in xs)
        return {"p50_us": statistics.median(xs), "p99_us": xs[int(0.99 * (len(xs) - 1))]}

    per_request = [sum(parts) for parts in zip(*seconds.values())]
    return {
        "replicas": replicas,
        "prompt_tokens": prompt_tokens,
        "decisions": decisions,
        **{part: pcts(xs) for part, xs in seconds.items()},
        "total_p50_us": statistics.median(per_request) * 1e6,
    }


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m load_tests.router_micro", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="10,100,200")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--decisions", type=int, default=500)
    args = p.parse_args(argv)
    print(
        f"{'replicas':>8} {'prompt tok':>10} "
        + " ".join(f"{part + ' p50':>12}" for part in PARTS)
        + f" {'score p99':>10} {'request p50':>12}"
    )
    out = []
    for n in map(int, args.replicas.split(",")):
        r = time_decisions(n, args.prompt_tokens, args.decisions)
        out.append(r)
        print(
            f"{n:>8} {args.prompt_tokens:>10} "
            + " ".join(f"{r[part]['p50_us']:>10.0f}us" for part in PARTS)
            + f" {r['score']['p99_us']:>8.0f}us {r['total_p50_us']:>10.0f}us"
        )
    return out


if __name__ == "__main__":
    main()
