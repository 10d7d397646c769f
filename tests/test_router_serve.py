"""LLMRouter on real Serve, over HTTP, with 4 simulated replicas per app (sim:cpu-smollm2: steps of
tens of milliseconds that sleep, so 8 replicas fit on 2 cores)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.test_serve_replicas import replica_stats

pytestmark = pytest.mark.slow

REPLICAS = 4


def sim_config(router_class=None) -> dict:
    router = {"request_routing_stats_period_s": 0.2}
    if router_class:
        router["request_router_class"] = router_class
    return {
        "engine": {"model": "sim:cpu-smollm2", "num_kv_blocks": 256, "block_size": 8, "max_num_seqs": 16},
        "replica": {"num_replicas": REPLICAS},
        "stream": {"interval_ms": 10},
        "router": router,
    }


@pytest.fixture(scope="module")
def sim_apps(serve_cluster):
    urls = {"default": serve_cluster.deploy("simdefault", sim_config()),
            "llm": serve_cluster.deploy("simllm", sim_config("router:LLMRouter"))}
    yield urls
    for name in ("simdefault", "simllm"):  # 10 actors: give the memory back to later tests
        serve_cluster.delete(name)


async def chat_sessions(url: str, users: int, turns: int) -> tuple:
    """`users` concurrent multi-turn chats sharing one system prompt; returns (prompt, cached) tokens.
    The history outweighs the system prompt (which any router ends up caching everywhere), so the
    share measures whether turn n+1 finds turn n."""
    system = "You are a helpful assistant of the simulation test suite. " * 4
    totals = [0, 0]

    async def user(client, u):
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"User {u}, turn {t}: " + f"tell me about topic {u}. " * 12})
            r = await client.post(f"{url}/v1/chat/completions",
                                  json={"messages": messages, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            totals[0] += body["usage"]["prompt_tokens"]
            totals[1] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(user(client, u) for u in range(users)))
    return tuple(totals)


def test_models_say_the_replicas_are_simulated(sim_apps):
    card = httpx.get(f"{sim_apps['llm']}/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == "sim:cpu-smollm2" and "simulated" in card["simulation"]


def test_shared_prefix_chats_get_more_cached_tokens_than_serves_default(sim_apps):
    shares = {}
    for name in ("default", "llm"):
        prompt, cached = asyncio.run(chat_sessions(sim_apps[name], users=8, turns=4))
        shares[name] = cached / prompt
    # Turn n+1 finds turn n's blocks only where turn n ran: 1 in 4 by chance, mostly with LLMRouter.
    assert shares["llm"] > 1.25 * shares["default"] and shares["llm"] > 0.5, shares


def test_a_replica_whose_kv_is_full_gets_no_new_requests(sim_apps):
    url = sim_apps["llm"]
    before = replica_stats("simllm", REPLICAS)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            def completion(prompt, max_tokens):
                return client.post(f"{url}/v1/completions",
                                   json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
            # Three requests that each fill a replica's 256 KV blocks (1990 + 40 tokens of 2048).
            longs = [asyncio.ensure_future(completion([300 + i] * 1990, 40)) for i in range(3)]
            deadline = time.monotonic() + 60
            while True:  # until three replicas report (almost) no free block
                stats = await asyncio.to_thread(replica_stats, "simllm", REPLICAS)  # .result() refuses a loop
                full = [s for s in stats.values() if s["kv_blocks_free"] <= 6]
                if len(full) == 3:
                    break
                assert time.monotonic() < deadline, "the long requests never filled three replicas"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.6)  # reports reach the routers every 0.2 s
            shorts = await asyncio.gather(*(completion([700 + i] * 120, 4) for i in range(6)))
            return shorts, await asyncio.gather(*longs)

    shorts, longs = asyncio.run(run())
    assert all(r.status_code == 200 for r in shorts + longs)
    after = replica_stats("simllm", REPLICAS)
    served = {rid: after[rid]["finished_requests"] - before[rid]["finished_requests"] for rid in after}
    # The three full replicas served their long request only; the one with room took every short one.
    assert sorted(served.values()) == [1, 1, 1, 6], served
