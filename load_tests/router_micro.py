"""`python -m load_tests.router_micro`: how long one LLMRouter decision takes at 100+ replicas.

No Ray cluster: the router scores stand-ins for Serve's RunningReplica (an id and fresh routing
stats); every replica's prefix index holds a shared system prompt plus conversations of its own,
and this router has requests in flight on each. Times `prepare` (hashing the prompt) and `score`
(index lookups, load estimates, ranking) separately, as p50/p99 over many decisions.
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

    router = LLMRouter(deployment_id=DeploymentID(name="LLMServer", app_name="micro"),
                       handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model=MODEL, block_size=block_size, max_num_batched_tokens=2048, max_num_seqs=64,
                            cost_model="h100-llama3-8b")
    return router


def fake_fleet(router, replicas: int, prompt_tokens: int, seed: int = 0) -> List[SimpleNamespace]:
    from ray.serve._private.common import DeploymentID, ReplicaID

    rng, now, root = random.Random(seed), time.time(), root_hash(MODEL)
    system = list(range(1000, 1000 + prompt_tokens // 2))
    fleet = []
    for i in range(replicas):
        rid = ReplicaID(unique_id=f"r{i}", deployment_id=DeploymentID(name="LLMServer", app_name="micro"))
        running = rng.randrange(64)
        fleet.append(SimpleNamespace(replica_id=rid, routing_stats={
            "time_s": now - 0.2, "waiting": rng.randrange(4), "running": running,
            "queued_prefill_tokens": rng.randrange(4096), "context_tokens": running * 1500,
            "kv_blocks_free": rng.randrange(50_000), "kv_blocks_total": 50_000}))
        for c in range(20):  # conversations this replica holds
            router.index.insert(rid.unique_id, cacheable_block_hashes(system + [i, c] * (prompt_tokens // 4), 8, root))
        for k in range(8):  # requests this router sent it, not confirmed yet (their prefixes claimed there)
            ids = system + [i, 20 + k] * (prompt_tokens // 4)
            hashed = router.prepare(PreparedRequest(f"{i}-{k}", ids, SamplingParams(max_tokens=128)))
            router.ledger.chosen(f"{i}-{k}", rid.unique_id, hashed, prompt_tokens // 2, now - rng.random())
    return fleet


def time_decisions(replicas: int, prompt_tokens: int, decisions: int) -> dict:
    router = make_router()
    fleet = fake_fleet(router, replicas, prompt_tokens)
    system = list(range(1000, 1000 + prompt_tokens // 2))
    prep_s, score_s = [], []
    for d in range(decisions):
        ids = system + [d % replicas, d % 20] * (prompt_tokens // 4)
        request = PreparedRequest(str(d), ids, SamplingParams(max_tokens=128))
        t0 = time.perf_counter()
        prepared = router.prepare(request)
        t1 = time.perf_counter()
        router.score(fleet, prepared)
        score_s.append(time.perf_counter() - t1)
        prep_s.append(t1 - t0)

    def pcts(xs):
        xs = sorted(x * 1e6 for x in xs)
        return {"p50_us": statistics.median(xs), "p99_us": xs[int(0.99 * (len(xs) - 1))]}

    return {"replicas": replicas, "prompt_tokens": prompt_tokens, "decisions": decisions,
            "prepare": pcts(prep_s), "score": pcts(score_s),
            "total_p50_us": statistics.median(a + b for a, b in zip(prep_s, score_s)) * 1e6}


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m load_tests.router_micro", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="10,100,200")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--decisions", type=int, default=500)
    args = p.parse_args(argv)
    print(f"{'replicas':>8} {'prompt tok':>10} {'prepare p50':>12} {'score p50':>10} {'score p99':>10} {'total p50':>10}")
    out = []
    for n in map(int, args.replicas.split(",")):
        r = time_decisions(n, args.prompt_tokens, args.decisions)
        out.append(r)
        print(f"{n:>8} {args.prompt_tokens:>10} {r['prepare']['p50_us']:>10.0f}us {r['score']['p50_us']:>8.0f}us "
              f"{r['score']['p99_us']:>8.0f}us {r['total_p50_us']:>8.0f}us")
    return out


if __name__ == "__main__":
    main()
