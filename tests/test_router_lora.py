"""LLMRouter with LoRA adapters, fake replicas (no Ray): the adapter is the first signal, a hot adapter
spreads, a cold one goes where loading costs least, and prefix hashes are rooted per adapter."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from batcher.block_hash import cacheable_block_hashes, root_hash
from router.scoring import Report, adapter_costs
from tests.router_harness import BS, MODEL, SYSTEM, blocks, make_router, replica, request

CACHE_ID = "A@digest1"  # what replicas holding adapter A report (batcher.block_hash.adapter_cache_id)


def lora_request(ids, adapter="A", request_id="r", max_tokens=64):
    return dataclasses.replace(request(ids, request_id, max_tokens), lora_name=adapter)


def test_the_replica_holding_the_adapter_wins_at_even_load():
    router, now = make_router(), time.time()
    reps = [
        replica(n, now, running=4, context_tokens=2000, loras={"A": CACHE_ID} if n == "c" else {"B": "B@x"})
        for n in "abcd"
    ]
    ranking = router.score(reps, router.prepare(lora_request(list(range(100)))), now)
    assert ranking[0].replica == "c"
    # The base model's requests do not care who holds adapters: every replica scores the same.
    base = router.score(reps, router.prepare(request(list(range(100)))), now)
    assert len({round(s.seconds, 9) for s in base}) == 1


def test_among_holders_load_decides():
    router, now = make_router(), time.time()
    busy = replica("busy", now, running=40, context_tokens=40 * 800, loras={"A": CACHE_ID})
    calm = replica("calm", now, running=2, context_tokens=1000, loras={"A": CACHE_ID})
    idle = replica("idle", now)  # lacks A
    ranking = router.score([busy, calm, idle], router.prepare(lora_request(list(range(100)))), now)
    assert ranking[0].replica == "calm"


def test_a_hot_adapter_spreads_when_its_holder_is_loaded_beyond_the_load_cost():
    """The rule: a replica lacking the adapter wins once the holder's expected seconds exceed its own
    plus `adapter_load_s`; a holder only somewhat busier keeps the adapter's traffic."""
    router, now = make_router(), time.time()
    req = router.prepare(lora_request(list(range(200))))
    idle = replica("idle", now)
    # Somewhat busier than the others (within the load bound): it keeps the adapter's traffic.
    mild = replica("holder", now, running=4, context_tokens=2000, loras={"A": CACHE_ID})
    others = [replica(n, now, running=3, context_tokens=1500) for n in "xy"]
    ranking = router.score([mild] + others, req, now)
    assert ranking[0].replica == "holder"
    hot = replica(
        "holder",
        now,
        running=64,
        waiting=30,
        queued_prefill_tokens=30 * 500,
        context_tokens=64 * 600,
        loras={"A": CACHE_ID},
    )
    ranking = router.score([hot, idle], req, now)
    assert [s.replica for s in ranking] == ["idle", "holder"]
    assert ranking[1].seconds > ranking[0].seconds  # idle's seconds include adapter_load_s


def test_the_load_cost_is_what_the_config_says():
    router, now = make_router(adapter_load_s=3.0), time.time()
    reps = [replica("holder", now, loras={"A": CACHE_ID}), replica("other", now)]
    ranking = router.score(reps, router.prepare(lora_request(list(range(50)))), now)
    by = {s.replica: s.seconds for s in ranking}
    assert abs(by["other"] - by["holder"] - 3.0) < 1e-9


def test_a_cold_adapter_goes_where_loading_costs_least():
    router, now = make_router(), time.time()
    full = {f"x{i}": f"x{i}@d" for i in range(6)}
    reps = [replica("crowded", now, loras=full), replica("empty", now), replica("some", now, loras={"y": "y@d"})]
    for i in range(20):  # ties broken at random: the fewest resident adapters wins every time
        ranking = router.score(reps, router.prepare(lora_request(list(range(50)), adapter=f"cold{i}")), now)
        assert ranking[0].replica == "empty" and ranking[-1].replica == "crowded"
    # ... but load comes first: an empty replica far busier loses to a crowded idle one.
    reps[1] = replica("empty", now, running=64, waiting=20, queued_prefill_tokens=20 * 500, context_tokens=64 * 600)
    ranking = router.score(reps, router.prepare(lora_request(list(range(50)), adapter="cold")), now)
    assert ranking[0].replica != "empty"


def test_a_burst_for_a_cold_adapter_follows_its_first_request_before_any_report(serving):
    """No replica reports the adapter yet: the first request picks one, the rest of the burst
    follows it there (one load, not one per replica) within the load bound."""
    router, now = make_router(), time.time()
    serve = serving(router, [replica(n, now, age_s=0.01, running=10, context_tokens=5000) for n in "abcd"])
    first = serve.route(lora_request(list(range(64)), request_id="u0"), "k0")
    chosen = [
        serve.route(lora_request(list(range(64 * i, 64 * i + 64)), request_id=f"u{i}"), f"k{i}") for i in range(1, 4)
    ]
    assert chosen == [first] * 3
    other = serve.route(lora_request(list(range(64)), adapter="B", request_id="v"), "kv")
    assert other != first  # another cold adapter: where nothing waits to load


def test_prefix_hashes_are_rooted_by_the_adapter_cache_id_replicas_report():
    router, now = make_router(), time.time()
    reps = [replica("a", now, loras={"A": CACHE_ID}), replica("b", now)]
    router.score(reps, router.prepare(request([1])), now)  # reads the reports
    prompt = SYSTEM + [5, 6, 7]
    req = router.prepare(lora_request(prompt))
    engine_chain = cacheable_block_hashes(prompt, BS, root_hash(MODEL, None, adapter=CACHE_ID))
    assert req.hashes == engine_chain and req.root == root_hash(MODEL, None, adapter=CACHE_ID)
    # The base model's blocks never match an adapter's request, nor the other way round.
    router.index.insert("b", blocks(prompt))
    assert router.score(reps, req, now)[0].cached_tokens == 0
    assert max(s.cached_tokens for s in router.score(reps, router.prepare(request(prompt)), now)) == 400


def test_serves_multiplexed_model_id_names_the_adapter_of_other_calls():
    router = make_router()
    req = router.prepare(request(list(range(20))), "A")  # a PreparedRequest without lora_name
    assert req.adapter == "A" and req.root == root_hash(MODEL, None, adapter="A")
    assert router.prepare(request(list(range(20)))).adapter is None


def test_report_parses_resident_adapters():
    report = Report.parse({"time_s": 1.0, "waiting": 0, "loras": {"A": CACHE_ID}})
    assert report.loras == {"A": CACHE_ID}
    assert Report.parse({"time_s": 1.0}).loras == {}


def test_adapter_costs():
    costs = adapter_costs(np.array([True, False, False]), np.array([5.0, 0.0, 5.0]), 1.0)
    assert costs[0] == 0 and costs[1] == 1.0 and 1.0 < costs[2] <= 1.5
