"""Faults on real Serve: a replica killed mid-stream, a redeploy under open streams, a stuck engine loop.

The apps run simulated replicas (`sim:cpu-smollm2`: the real engine and Serve plumbing, ~60-70 ms
sleeping steps), so streams stay open for seconds without using the cores. Each test deploys its own
app on the session cluster and deletes it at the end.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from deployments.llm_server import TEST_HOOKS_ENV

SIM = "sim:cpu-smollm2"
# Deadlines against a hang only, generous for a busy 2-core machine: what the tests check is the
# error events, finish reasons and replica ids.
KILLED_STREAM_END_S = 60.0  # every open stream ends, with an error event, after the kill
RECOVERY_S = 120.0  # a new replica answers after a kill or a failed health check


def sim_config(**replica) -> dict:
    return {
        "engine": {"model": SIM, "max_num_seqs": 16, "num_kv_blocks": 2048},
        "replica": {"num_replicas": 1, **replica},
        "stream": {"interval_ms": 10},
    }


@pytest.fixture
def fault_app(serve_cluster):
    """Deploys apps by name for one test (AppConfig dicts) and removes them afterwards."""
    names = []

    def deploy(name: str, config: dict) -> str:
        names.append(name)
        return serve_cluster.deploy(name, config)

    yield deploy
    for name in names:
        serve_cluster.delete(name)


@dataclass
class Stream:
    """One streamed completion read to its end: what came, and when it ended."""

    status: int = 0
    replica: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None
    error: Optional[dict] = None
    done: bool = False
    ended_at: Optional[float] = None
    first: asyncio.Event = field(default_factory=asyncio.Event)


async def read_stream(client: httpx.AsyncClient, url: str, body: dict, s: Stream) -> Stream:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            s.status, s.replica = r.status_code, r.headers.get("x-iterserve-replica", "")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    s.done = True
                    continue
                event = json.loads(data)
                s.first.set()
                if "error" in event:
                    s.error = event["error"]
                for choice in event.get("choices") or []:
                    s.finish_reason = choice.get("finish_reason") or s.finish_reason
                if event.get("usage"):
                    s.completion_tokens = event["usage"]["completion_tokens"]
    finally:
        s.ended_at = time.monotonic()
        s.first.set()
    return s


async def answered_by_new_replica(client: httpx.AsyncClient, url: str, old: str, bound_s: float) -> float:
    """Polls a short request until a replica other than `old` answers it; returns the seconds taken."""
    t0 = time.monotonic()
    while True:
        r = await client.post(f"{url}/v1/completions", json={"prompt": "still there?", "max_tokens": 4})
        if r.status_code == 200 and r.headers["x-iterserve-replica"] != old:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            return time.monotonic() - t0
        assert time.monotonic() - t0 < bound_s, f"no new replica answered within {bound_s} s: {r.status_code} {r.text}"
        await asyncio.sleep(0.5)


def replica_actor(app: str, replica_id: str):
    return ray.get_actor(f"SERVE_REPLICA::{app}#LLMServer#{replica_id}", namespace="serve")


@pytest.mark.slow
def test_replica_killed_mid_stream_ends_every_stream_and_recovers(fault_app):
    url = fault_app("fault-kill", sim_config())
    body = {"prompt": "a long story", "max_tokens": 1000, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [Stream() for _ in range(4)]
            tasks = [asyncio.create_task(read_stream(client, url, body, s)) for s in streams]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            assert all(s.status == 200 and s.error is None for s in streams), streams
            [replica] = {s.replica for s in streams}
            killed = time.monotonic()
            ray.kill(replica_actor("fault-kill", replica), no_restart=True)
            await asyncio.wait_for(asyncio.gather(*tasks), KILLED_STREAM_END_S)
            for s in streams:  # cut short (no finish reason), told so in-band, and closed properly
                assert s.error is not None and s.error["type"] == "service_unavailable_error", s
                assert s.done and s.finish_reason is None, s
            recovered = await answered_by_new_replica(client, url, replica, RECOVERY_S)
            return max(s.ended_at - killed for s in streams), recovered

    ended, recovered = asyncio.run(main())
    print(f"streams ended {ended:.1f} s after the kill; a new replica answered after {recovered:.1f} s")


@pytest.mark.slow
def test_redeploy_with_open_streams_completes_every_accepted_request(fault_app):
    """`serve.run` of the same app with a changed stream window replaces the ingress and the LLM
    replica. Streams open before it (longer than Serve's default 20 s shutdown window) finish in
    full, and every request sent while it runs is answered."""
    config = sim_config()
    url = fault_app("fault-redeploy", config)
    long_body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True}

    def redeploy(done: threading.Event):
        try:
            changed = {**config, "stream": {"interval_ms": 25}}
            serve.run(build_app(changed), name="fault-redeploy", route_prefix="/fault-redeploy")
        finally:
            done.set()

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            streams = [Stream() for _ in range(3)]
            tasks = [asyncio.create_task(read_stream(client, url, long_body, s)) for s in streams]
            await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 60)
            [old] = {s.replica for s in streams}
            t0, deployed = time.monotonic(), threading.Event()
            threading.Thread(target=redeploy, args=(deployed,), daemon=True).start()
            # Traffic during the redeploy: a short stream and a short non-streamed request every 0.5 s.
            during: List[asyncio.Task] = []
            while not (deployed.is_set() and all(t.done() for t in tasks)):
                assert time.monotonic() - t0 < 240, "redeploy did not finish"
                short = {"prompt": f"during {len(during)}", "max_tokens": 8, "ignore_eos": True}
                during.append(asyncio.create_task(read_stream(client, url, short, Stream())))
                during.append(asyncio.create_task(client.post(f"{url}/v1/completions", json=short)))
                await asyncio.sleep(0.5)
            finished = await asyncio.gather(*tasks)
            answers = await asyncio.gather(*during)
            return old, finished, answers, time.monotonic() - t0

    old, finished, answers, took = asyncio.run(main())
    for s in finished:  # every accepted stream completed: finish_reason, all its tokens, [DONE]
        assert s.error is None and s.finish_reason == "length" and s.completion_tokens == 400 and s.done, s
    streamed = [a for a in answers if isinstance(a, Stream)]
    plain = [a for a in answers if isinstance(a, httpx.Response)]
    assert len(streamed) == len(plain) >= 10
    assert all(s.status == 200 and s.error is None and s.done and s.completion_tokens == 8 for s in streamed), [
        s for s in streamed if not (s.status == 200 and s.done)
    ]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8 for r in plain), [
        (r.status_code, r.text) for r in plain if r.status_code != 200
    ]
    new = {s.replica for s in streamed} | {r.headers["x-iterserve-replica"] for r in plain}
    assert new - {old}, "the redeploy never brought up a new replica"
    print(f"redeploy: {len(answers)} requests sent during {took:.1f} s, all answered; replicas {sorted(new)}")


@pytest.mark.slow
def test_stuck_engine_loop_fails_health_and_is_replaced(fault_app):
    url = fault_app(
        "fault-stall",
        {
            **sim_config(
                health_check_period_s=1,
                health_check_timeout_s=5,
                graceful_shutdown_timeout_s=3,
                env_vars={TEST_HOOKS_ENV: "1"},
            ),
            "engine": {**sim_config()["engine"], "stall_timeout_s": 2},
        },
    )
    handle = serve.get_deployment_handle("LLMServer", "fault-stall")
    old = handle.stats.remote().result()["replica_id"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            s = Stream()
            task = asyncio.create_task(
                read_stream(client, url, {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}, s)
            )
            await asyncio.wait_for(s.first.wait(), 60)
            assert s.replica == old and s.error is None
            stalled = time.monotonic()
            await handle.stall_engine_for_tests.remote(600)  # the loop now hangs, its stream open
            recovered = await answered_by_new_replica(client, url, old, RECOVERY_S)
            await asyncio.wait_for(task, 30)
            assert s.error is not None and s.done and s.finish_reason is None, s  # told in-band, not hung
            return recovered, s.ended_at - stalled

    recovered, ended = asyncio.run(main())
    assert handle.stats.remote().result()["replica_id"] != old
    print(
        f"stuck loop: a new replica answered {recovered:.1f} s after the stall; the stalled stream ended "
        f"after {ended:.1f} s"
    )


def test_stall_hook_is_refused_without_the_test_env(fault_app):
    fault_app("fault-nohooks", sim_config())
    handle = serve.get_deployment_handle("LLMServer", "fault-nohooks")
    with pytest.raises(PermissionError, match=TEST_HOOKS_ENV):
        handle.stall_engine_for_tests.remote(1).result()
    assert handle.check_health.remote().result() is None
