"""Two replicas share the traffic; a client that disconnects mid-stream gets its KV blocks back."""
from __future__ import annotations

import asyncio
import time

import httpx
from ray import serve


def replica_stats(app: str, replicas: int = 2) -> dict:
    """Engine stats of every LLM replica of `app`, by replica id (the handle reaches a random one)."""
    handle = serve.get_deployment_handle("LLMServer", app)
    seen: dict = {}
    for _ in range(200):
        s = handle.stats.remote().result()
        seen[s["replica_id"]] = s
        if len(seen) == replicas:
            return seen
    raise AssertionError(f"reached only {len(seen)} of {replicas} replicas")


def test_two_replicas_both_serve_traffic(tiny_app):
    before = replica_stats("tiny")

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(
                client.post(f"{tiny_app}/v1/completions",
                            json={"prompt": f"request {i}", "max_tokens": 64, "ignore_eos": True})
                for i in range(16)))

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
        disconnected = time.monotonic()  # leaving the block closed the connection mid-stream
    while True:
        after = replica_stats("tiny")
        if all(s["running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] for s in after.values()):
            break
        assert time.monotonic() - disconnected < 5, after
        time.sleep(0.05)
    # Generating 1900 tokens takes several seconds: the blocks came back because of the abort.
    assert sum(after[r]["aborted_requests"] - before[r]["aborted_requests"] for r in after) == 1
    assert sum(after[r]["finished_requests"] - before[r]["finished_requests"] for r in after) == 0


def test_replica_reports_load_for_router_and_autoscaler(tiny_app):
    """The hooks Serve polls: record_routing_stats (router), record_autoscaling_stats (policy),
    check_health (replacement). Called here through the handle like any method."""
    handle = serve.get_deployment_handle("LLMServer", "tiny")
    routing = handle.record_routing_stats.remote().result()
    assert {"waiting", "running", "kv_usage", "kv_blocks_free", "kv_blocks_total"} <= set(routing)
    assert routing["request_ids"] == []  # idle: it holds no request
    autoscaling = handle.record_autoscaling_stats.remote().result()
    assert set(autoscaling) == {"waiting", "running", "kv_usage", "kv_blocks_free", "finished", "preemptions"}
    assert all(isinstance(v, float) for v in autoscaling.values())
    assert autoscaling["kv_blocks_free"] == routing["kv_blocks_total"] == 512  # idle: every block free
    assert handle.check_health.remote().result() is None
