"""LLMRouter as Serve drives it, without a Ray cluster: stand-ins for Serve's RunningReplica and
PendingRequest, real PreparedRequests, and `Serving`, which calls the router's hooks in Serve's order
on one event loop (tests/conftest.py's `serving` fixture makes them). Shared by the router tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import List, Optional

from batcher.block_hash import cacheable_block_hashes, root_hash
from batcher.sampling_params import SamplingParams
from deployments.protocol import PreparedRequest

BS = 8
MODEL = "test-model"  # the engine's model: the root of the replicas' block hashes
SYSTEM = list(range(1000, 1400))  # a 400-token shared system prompt


def blocks(ids, cache_salt: Optional[str] = None) -> list:
    """The block hashes a replica of MODEL caches for prompt `ids`."""
    return cacheable_block_hashes(ids, BS, root_hash(MODEL, cache_salt))


def make_router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.llm_router import LLMRouter

    router = LLMRouter(
        deployment_id=DeploymentID(name="LLMServer", app_name="test"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    # share_index_s 0: these routers never exchange with a cluster's, even where a test session has
    # one running (tests/test_index_exchange.py starts theirs on an in-process exchange).
    # index_stride_tokens BS: an index of every block, so the tests count matches in blocks; the
    # default's one block in four has tests of its own (tests/test_router_ledger.py).
    router.initialize_state(
        **{
            "model": MODEL,
            "block_size": BS,
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 64,
            "cost_model": "h100-llama3-8b",
            "share_index_s": 0,
            "index_stride_tokens": BS,
            **kwargs,
        }
    )
    return router


async def _queue_len(deadline_s: float) -> int:
    return 0


def replica(name: str, now: float, age_s: float = 0.1, **stats):
    """A RunningReplica stand-in: an id, the routing stats LLMServer.record_routing_stats reports, and
    the queue-length probe Serve sends replicas it is told of."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    report = {
        "time_s": now - age_s,
        "waiting": 0,
        "running": 0,
        "queued_prefill_tokens": 0,
        "context_tokens": 0,
        "kv_blocks_free": 10_000,
        "kv_blocks_total": 10_000,
        **stats,
    }
    replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="LLMServer", app_name="test"))
    return SimpleNamespace(
        replica_id=replica_id, routing_stats=report, get_queue_len=_queue_len, max_ongoing_requests=1000
    )


def request(ids, request_id="r", max_tokens=64, cache_salt=None) -> PreparedRequest:
    """What the ingress hands the LLM deployment (and so its router)."""
    return PreparedRequest(
        request_id=request_id,
        prompt_token_ids=list(ids),
        params=SamplingParams(max_tokens=max_tokens),
        cache_salt=cache_salt,
    )


def pending(req, key: str):
    """A PendingRequest stand-in: the call's arguments and Serve's internal request id."""
    return SimpleNamespace(args=[req] if req is not None else [], metadata=SimpleNamespace(internal_request_id=key))


class Serving:
    """A router driven as Serve drives it: on one event loop, told of its replicas (update_replicas),
    each request decided (choose_replicas), then confirmed on a replica and completed there."""

    def __init__(self, router, replicas: list):
        self.router, self.ids = router, {}
        self.loop = asyncio.new_event_loop()
        self.update(replicas)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def update(self, replicas: list) -> None:
        async def update():
            self.router.update_replicas(replicas)
            await asyncio.sleep(0.01)  # Serve's probes of new replicas' queues

        self.ids.update((r.replica_id.unique_id, r.replica_id) for r in replicas)
        self.run(update())

    def id(self, name: str):
        return self.ids[name]

    def choose(self, req, key: str) -> List[str]:
        """The ranked first choices for request `key` among the replicas Serve has (curr_replicas)."""
        candidates = list(self.router.curr_replicas.values())
        groups = self.run(self.router.choose_replicas(candidates, pending(req, key)))
        return [g[0].replica_id.unique_id for g in groups]

    def confirm(self, key: str, name: str) -> None:
        self.router.on_request_routed(pending(None, key), self.id(name), None)

    def route(self, req, key: str, to: Optional[str] = None) -> str:
        """Decides, then Serve confirms the first choice (or `to`); returns the replica."""
        first = self.choose(req, key)[0]
        self.confirm(key, to or first)
        return to or first

    def complete(self, key: str, name: str) -> None:
        self.router.on_request_completed(self.id(name), key)

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()
