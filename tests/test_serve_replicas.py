"""Two replicas share the traffic; a client that disconnects mid-stream gets its KV blocks back."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import httpx
from conftest import replica_stats, wait_until
from ray import serve


def idle(stats: dict) -> dict:
    """`stats` (by replica) if every replica holds no request and has every KV block free, else {}."""
    ok = all(s["running"] == s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats.values())
    return stats if ok else {}


def reports(method, until: Callable[[dict], bool], calls: int = 200) -> dict:
    """Calls a replica hook through the handle (a random replica each time) until one report matches."""
    for _ in range(calls):
        report = method.remote().result()
        if until(report):
            return report
    raise AssertionError(f"no report matched in {calls} calls; the last: {report}")


def test_two_replicas_both_serve_traffic(tiny_app):
    before = replica_stats("tiny")

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{tiny_app}/v1/completions",
                        json={"prompt": f"request {i}", "max_tokens": 64, "ignore_eos": True},
                    )
                    for i in range(16)
                )
            )

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    after = replica_stats("tiny")
    served = {rid: after[rid]["finished_requests"] - before[rid]["finished_requests"] for rid in after}
    assert sum(served.values()) == 16
    assert all(n > 0 for n in served.values()), served
    # Each answer names the replica that served it, and the names add up to the replicas' counts.
    by_header = [r.headers["x-iterserve-replica"] for r in responses]
    assert {rid: by_header.count(rid) for rid in served} == served


def test_disconnect_mid_stream_frees_kv_blocks(tiny_app):
    before = replica_stats("tiny")
    body = {"prompt": "tell me a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{tiny_app}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept open: dropping a half-read iterator closes the connection
            events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
            assert len(events) == 3 and not any("error" in e or "[DONE]" in e for e in events), events
            during = replica_stats("tiny")
            busy = [s for s in during.values() if s["kv_blocks_free"] < s["kv_blocks_total"]]
            assert len(busy) == 1 and busy[0]["running"] == 1, during
    # Leaving the blocks closed the connection mid-stream.
    after = wait_until(lambda: idle(replica_stats("tiny")), 60, "every KV block back after the disconnect")
    # The blocks came back because of the abort, not because the 1900 tokens were all generated.
    assert sum(after[r]["aborted_requests"] - before[r]["aborted_requests"] for r in after) == 1
    assert sum(after[r]["finished_requests"] - before[r]["finished_requests"] for r in after) == 0


def test_replica_reports_load_for_router_and_autoscaler(tiny_app):
    """The hooks Serve polls, called through the handle like any method: record_routing_stats (router)
    and record_autoscaling_stats (policy) report the open stream on the replica serving it, by its
    request id, and nothing once it is gone; check_health passes throughout."""
    handle = serve.get_deployment_handle("LLMServer", "tiny")
    body = {"prompt": "tell me a long story", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{tiny_app}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept open until the block ends
            request_id = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
            routing = reports(handle.record_routing_stats, lambda s: s["running"] > 0)
            assert routing["request_ids"] == [request_id] and routing["running"] == 1, routing
            assert routing["kv_blocks_free"] < routing["kv_blocks_total"] and routing["kv_usage"] > 0
            autoscaling = reports(handle.record_autoscaling_stats, lambda s: s["running"] > 0)
            assert autoscaling["running"] == 1.0 and autoscaling["kv_blocks_free"] < routing["kv_blocks_total"]
            assert handle.check_health.remote().result() is None
    wait_until(lambda: idle(replica_stats("tiny")), 60, "both replicas idle after the disconnect")
    capacities = []
    for _ in range(20):  # random replicas: both are reached (all but surely)
        routing = handle.record_routing_stats.remote().result()
        assert routing["request_ids"] == [] and routing["running"] == 0, routing
        assert routing["kv_blocks_free"] == routing["kv_blocks_total"]
        autoscaling = handle.record_autoscaling_stats.remote().result()
        assert autoscaling["running"] == 0.0 and autoscaling["kv_blocks_free"] == routing["kv_blocks_total"]
        capacities.append(autoscaling.get("capacity"))
    # What a replica would complete full (req/s), from its step times and its requests' size: known
    # on the replica that served the stream (its request ended); until then left out, never 0.
    known = [c for c in capacities if c is not None]
    assert known and all(0 < c < 1e6 for c in known), capacities
    assert handle.check_health.remote().result() is None
