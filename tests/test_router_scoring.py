"""LLMRouter's decision with fake replicas (no Ray cluster): affinity, load, staleness, bounds, bursts."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from batcher.simulated import PRESETS
from router.scoring import ReplicaLoad, Report, Routed, fleet_loads, load_row, own_load, prefill_backlog, replica_load
from tests.router_harness import BS, SYSTEM, blocks, make_router, pending, replica, request

H100 = PRESETS["h100-llama3-8b"]


def test_affinity_wins_when_load_is_even():
    router, now = make_router(), time.time()
    reps = [replica(n, now, running=8, context_tokens=4000) for n in "abcd"]
    router.index.insert(reps[2].replica_id.unique_id, blocks(SYSTEM + [1]))
    scores = router.score(reps, router.prepare(request(SYSTEM + [5, 6, 7])), now)
    assert scores[0].replica == "c"
    assert scores[0].cached_tokens == 400 and all(s.cached_tokens == 0 for s in scores[1:])


def test_load_wins_when_the_holder_is_hot():
    router, now = make_router(), time.time()
    hot = replica("hot", now, running=64, waiting=30, queued_prefill_tokens=30 * 500, context_tokens=64 * 600)
    idle = replica("idle", now)
    router.index.insert("hot", blocks(SYSTEM + [1]))
    scores = router.score([hot, idle], router.prepare(request(SYSTEM + [5])), now)
    assert [s.replica for s in scores] == ["idle", "hot"]
    # ... and the margin is what it costs: the holder's queue far exceeds recomputing 400 tokens.
    assert scores[1].seconds - scores[0].seconds > 400 * H100.step.prefill_token_s


def test_a_hot_prefix_spreads_instead_of_pinning_one_replica(serving):
    """Everyone shares one system prompt: the first holder takes requests until its queue costs more
    than recomputing the prefix elsewhere; then the prefix spreads and load stays even."""
    router, now = make_router(), time.time()
    serve = serving(router, [replica(n, now, age_s=0.01) for n in "abcd"])
    chosen = [serve.route(request(SYSTEM + [i, i + 1], f"u{i}"), f"k{i}") for i in range(40)]
    counts = {name: chosen.count(name) for name in "abcd"}
    assert max(counts.values()) <= 1.25 * (40 / 4) + 1, counts  # the load bound
    held = router.index.matched_blocks(blocks(SYSTEM + [0, 1]))
    assert held == {name: 50 for name in "abcd"}  # every replica now holds the prefix


def test_a_full_kv_cache_ranks_last_even_with_the_prefix():
    router, now = make_router(), time.time()
    full = replica("full", now, kv_blocks_free=3)
    busy = replica("busy", now, running=40, context_tokens=40 * 800)
    router.index.insert("full", blocks(SYSTEM + [1]))
    scores = router.score([full, busy], router.prepare(request(SYSTEM + list(range(200)))), now)
    assert [s.replica for s in scores] == ["busy", "full"] and scores[1].kv_full


def test_calls_that_are_not_generations_reach_every_replica_even_full_ones():
    """stats() has no prompt: no scoring, no tracking; any replica, so a poller reaches the busy ones."""
    router, now = make_router(), time.time()
    reps = [replica("full", now, kv_blocks_free=0)] + [replica(n, now) for n in "abc"]
    stats_call = pending(None, "s")
    firsts = set()
    for _ in range(200):
        groups = asyncio.run(router.choose_replicas(reps, stats_call))
        assert sorted(g[0].replica_id.unique_id for g in groups) == ["a", "b", "c", "full"]
        firsts.add(groups[0][0].replica_id.unique_id)
    assert firsts == {"a", "b", "c", "full"} and router.ledger.num_requests() == 0
    generation = pending(request(list(range(64))), "g")
    assert asyncio.run(router.choose_replicas(reps, generation))[-1] == [reps[0]]  # the full one ranks last


def test_stale_reports_count_as_unknown_not_idle():
    now = time.time()
    busy = (now, now, 3000, 40, 20_000, 100)
    rows = np.array([(now - 30, now - 30, 0, 0, 0, 10_000), busy, busy], dtype=float)
    filled = fleet_loads(rows, now, max_age_s=5, prefill_tokens_per_s=0, own=lambda i: ReplicaLoad(0, 0, 0, None))
    assert filled.batch[0] == 40 and filled.queued[0] == 3000  # the fleet's mean, not 0
    assert np.isnan(filled.kv_free[0])  # unknown, not the stale report's free blocks
    # With the router: an idle-looking stale replica does not attract the traffic.
    router = make_router(max_stats_age_s=5)
    stale_idle = replica("stale", now, age_s=30)
    loaded = [replica(n, now, running=40, queued_prefill_tokens=3000, context_tokens=20_000) for n in "xy"]
    scores = router.score([stale_idle] + loaded, router.prepare(request(list(range(64)))), now)
    assert len({round(s.seconds, 9) for s in scores}) == 1  # equal to the known ones, not preferred


def test_requests_routed_after_a_report_count_on_top_of_it():
    now = time.time()
    report = Report(
        time_s=now - 0.5,
        waiting=1,
        running=2,
        queued_prefill_tokens=100,
        context_tokens=300,
        kv_blocks_free=50,
        kv_blocks_total=64,
    )
    inflight = [Routed(now - 1.0, 64, 64), Routed(now - 0.1, 80, 40)]  # the first is in the report already
    load = replica_load(report, inflight, [], block_size=BS, prefill_tokens_per_s=0)
    assert (load.queued_prefill_tokens, load.batch, load.context_tokens, load.kv_blocks_free) == (140, 4, 380, 45)
    # As of now: less 0.5 s of prefill at 100 tokens/s since the report.
    load = replica_load(report, inflight, [], block_size=BS, prefill_tokens_per_s=100)
    now_load = fleet_loads(np.array([load_row(load)]), now, max_age_s=5, prefill_tokens_per_s=100, own=None)
    assert now_load.queued[0] == pytest.approx(90)


def test_a_prompt_sent_after_the_queue_ran_dry_is_not_worked_off_by_the_idle_time():
    """The replica reported 100 tokens queued 1 s ago and prefills 1000 a second: it was idle 0.9 s
    later, when this router sent it a 2000-token prompt. Now, 0.1 s after that, 1900 tokens are left.
    Decaying everything from the report's time counted the idle 0.9 s as work done (1100 left)."""
    now = time.time()
    report = Report(
        time_s=now - 1.0,
        waiting=1,
        running=0,
        queued_prefill_tokens=100,
        context_tokens=100,
        kv_blocks_free=500,
        kv_blocks_total=500,
    )
    load = replica_load(report, [Routed(now - 0.1, 2000, 2000)], [], block_size=BS, prefill_tokens_per_s=1000)
    now_load = fleet_loads(np.array([load_row(load)]), now, max_age_s=5, prefill_tokens_per_s=1000, own=None)
    assert now_load.queued[0] == pytest.approx(1900)
    # Two prompts sent back to back queue one behind the other: their sum, less the time since the first.
    sends = [Routed(now - 0.2, 500, 500), Routed(now - 0.1, 800, 800)]
    assert prefill_backlog(0.0, now - 1.0, sends, 1000) == (pytest.approx(1200), now - 0.1)
    assert own_load(sends, now, 1000).queued_prefill_tokens == pytest.approx(1100)
    # The router ranks by it. Both replicas reported empty queues a second ago; since then this router
    # sent `a` a 20,000-token prompt (0.7 s of prefill on the H100 prior), 0.1 s ago. `b` runs two
    # long conversations, so only `a`'s queue can make `b` the better choice; decayed from the
    # report's time, that queue was gone.
    router = make_router()
    reps = [replica("a", now, age_s=1.0), replica("b", now, age_s=1.0, running=2, context_tokens=2 * 12_000)]
    router.ledger.chosen("k1", "a", router.prepare(request(list(range(20_000)), "long")), 0, now - 0.1)
    router.ledger.routed("k1", "a", None, now - 0.1)
    assert router.score(reps, router.prepare(request(list(range(50_000, 50_600)))), now)[0].replica == "b"


def test_a_completion_after_the_report_is_taken_out_once(serving):
    """The report counts two requests; one completes after it: the replica has one. A later report
    that no longer counts it must not be corrected again (it would then look emptier than it is)."""
    router, now = make_router(), time.time()
    reps = [replica("a", now - 1, age_s=0)]
    serve = serving(router, reps)
    for i in (1, 2):
        serve.route(request(list(range(i * 100, i * 100 + 80)), f"t{i}"), f"k{i}")
    reps[0].routing_stats = {
        **reps[0].routing_stats,
        "time_s": time.time(),
        "running": 2,
        "context_tokens": 160,
        "request_ids": ["t1", "t2"],
    }
    assert router.load("a", reps[0].routing_stats).batch == 2  # both counted once, not four times
    serve.complete("k1", "a")
    # Scored as a replica that reports one running request, not two.
    twin = replica("b", reps[0].routing_stats["time_s"], age_s=0, running=1, context_tokens=80)
    ranking = router.score(reps + [twin], router.prepare(request(list(range(64)))))
    assert ranking[0].seconds == pytest.approx(ranking[1].seconds)
    assert router.load("a", reps[0].routing_stats).batch == 1
    assert router.load("a", reps[0].routing_stats).context_tokens == 80
    later = {
        **reps[0].routing_stats,
        "time_s": time.time() + 0.01,
        "running": 1,
        "context_tokens": 80,
        "request_ids": ["t2"],
    }
    assert router.load("a", later).batch == 1


def test_completions_are_matched_by_time_when_the_replica_lists_no_ids(serving):
    router, now = make_router(), time.time()
    reps = [replica("a", now - 1, age_s=0)]
    serve = serving(router, reps)
    serve.route(request(list(range(80)), "t1"), "k1")
    report = {**reps[0].routing_stats, "time_s": time.time(), "running": 1, "context_tokens": 80}
    serve.complete("k1", "a")
    assert router.load("a", report).batch == 0  # ended after the report: taken out
    later = {**report, "time_s": time.time() + 0.01, "running": 0, "context_tokens": 0}
    assert router.load("a", later).batch == 0  # reflected in the later report: not again


def test_the_loaded_row_follows_routing_and_completion(serving):
    """Decisions read cached per-replica rows: routing and completing a request must refresh them."""
    router, now = make_router(), time.time()
    reps = [replica("a", now), replica("b", now)]
    serve = serving(router, reps)
    other = router.prepare(request(list(range(5000, 5400)), "y"))  # no prefix in common: load decides
    assert len(router.score(reps, other, now)) == 2
    assert serve.route(request(list(range(400)), "x"), "k", to="a") == "a"
    assert router._row("a", reps[0].routing_stats)[3] == 1  # the batch column (scoring.load_row)
    assert router.score(reps, other, now)[0].replica == "b"
    serve.complete("k", "a")
    assert router._row("a", reps[0].routing_stats)[3] == 0


def test_affinity_margin_lets_a_somewhat_busier_holder_keep_the_conversation():
    now = time.time()
    reps = lambda: [replica("holder", now, running=12, context_tokens=12 * 600), replica("idle", now)]
    prompt = request(SYSTEM + [5, 6, 7])
    plain = make_router(load_bound=10, affinity_margin=1.0)  # the expected wait alone decides here
    plain.index.insert("holder", blocks(SYSTEM + [1]))
    scores = plain.score(reps(), plain.prepare(prompt), now)
    assert scores[0].replica == "idle"
    ratio = scores[1].seconds / scores[0].seconds
    sticky = make_router(load_bound=10, affinity_margin=ratio * 1.01)
    sticky.index.insert("holder", blocks(SYSTEM + [1]))
    assert sticky.score(reps(), sticky.prepare(prompt), now)[0].replica == "holder"
    with pytest.raises(ValueError):
        make_router(affinity_margin=0.5)


def test_the_margin_never_queues_a_request_longer_than_recomputing_its_prefix_elsewhere():
    """The tail rule. The holder of the 400-token system prompt has 1000 prompt tokens queued ahead:
    with its decode, its total is within the margin of the idle replica's, but its first token comes
    after the idle replica would have recomputed the whole prompt. The request goes to the idle one.
    With no queue at the holder, the margin keeps it there as before."""
    router, now = make_router(load_bound=10), time.time()
    prompt = router.prepare(request(SYSTEM + list(range(200)), max_tokens=64))
    router.index.insert("holder", blocks(SYSTEM + [1]))
    # Reports of this instant (at ~29k prompt tokens/s, a 0.1 s old queue would have drained).
    queued = [
        replica("holder", now, age_s=0, waiting=1, queued_prefill_tokens=1000, context_tokens=1000),
        replica("idle", now, age_s=0),
    ]
    scores = router.score(queued, prompt, now)
    by = {s.replica: s for s in scores}
    assert by["holder"].seconds < router.config.affinity_margin * by["idle"].seconds  # within the margin
    assert scores[0].replica == "idle"
    calm = [replica("holder", now, age_s=0, running=2, context_tokens=1200), replica("idle", now, age_s=0)]
    assert router.score(calm, prompt, now)[0].replica == "holder"


def test_at_100_replicas_a_conversation_finds_its_holder_and_serve_gets_every_replica_ranked():
    """At fleet scale (`python -m load_tests.router_micro` times these decisions): 100 equally loaded
    replicas share the system prompt and each holds conversations of its own; one is full. A turn
    goes to the one replica holding its conversation, never to the full one even when that holds it,
    and Serve gets all 100 back: the top ranks one by one, the rest as one group."""
    router, now = make_router(), time.time()
    names = [f"r{i}" for i in range(100)]
    reps = [
        replica(n, now, running=8, context_tokens=8 * 600, **({"kv_blocks_free": 0} if n == "r99" else {}))
        for n in names
    ]
    conversation = lambda i, c: SYSTEM + [i, c] * 300  # noqa: E731  (1000 tokens)
    for i, name in enumerate(names):
        for c in range(5):
            router.index.insert(name, blocks(conversation(i, c)))
    ranking = router.score(reps, router.prepare(request(conversation(37, 2) + [5, 6, 7])), now)
    assert ranking[0].replica == "r37" and ranking[0].cached_tokens == len(blocks(conversation(37, 2))) * BS
    assert {s.cached_tokens for s in ranking[1:]} == {len(SYSTEM)}  # the others share the system prompt only
    assert sorted(s.replica for s in ranking) == sorted(names)
    full = router.score(reps, router.prepare(request(conversation(99, 0) + [5, 6, 7])), now)
    assert full[-1].replica == "r99" and full[-1].kv_full and not full[0].kv_full
    groups = asyncio.run(router.choose_replicas(reps, pending(request(conversation(37, 2) + [8], "t"), "k")))
    assert [len(g) for g in groups] == [1, 1, 1, 97] and groups[0][0].replica_id.unique_id == "r37"
    assert sorted(r.replica_id.unique_id for g in groups for r in g) == sorted(names)


def test_a_burst_spreads_before_serve_confirms_any_request():
    """Serve routes a burst with concurrent tasks; on_request_routed comes later. Each decision must
    still see the ones before it, or the whole burst lands on one replica."""
    router, now = make_router(), time.time()
    reps = [replica(n, now) for n in "abcd"]

    async def burst():
        return [
            (
                await router.choose_replicas(
                    reps, pending(request(list(range(i * 1000, i * 1000 + 400)), f"b{i}"), f"burst{i}")
                )
            )[0][0].replica_id.unique_id
            for i in range(8)
        ]

    firsts = asyncio.run(burst())
    assert sorted(firsts.count(n) for n in "abcd") == [2, 2, 2, 2], firsts
    router.on_request_completed(reps["abcd".index(firsts[0])].replica_id, "burst0")  # completion uncounts it
    assert sum(len(router.ledger.inflight(n)) for n in "abcd") == 7


def test_a_burst_sharing_a_prefix_follows_its_first_request_before_serve_confirms_it():
    """Four users of each of two system prompts arrive at once: each prompt's later users go where its
    first one went (its prefix counts there from the decision on), so each prompt is computed on as
    few replicas as the load allows, not on every replica."""
    router, now = make_router(cost_model="cpu-smollm2"), time.time()
    reps = [replica(n, now) for n in "abcd"]
    systems = [list(range(1000, 1400)), list(range(3000, 3400))]

    def user(i):
        ids = systems[i % 2] + list(range(10_000 + 10 * i, 10_000 + 10 * i + 8))
        return pending(request(ids, f"u{i}"), f"b{i}")

    async def burst():
        return [(await router.choose_replicas(reps, user(i)))[0][0].replica_id.unique_id for i in range(8)]

    firsts = asyncio.run(burst())
    holders = [{firsts[i] for i in range(8) if i % 2 == p} for p in (0, 1)]
    assert all(len(h) <= 2 for h in holders), firsts  # without: every user to its own least loaded replica
    assert max(firsts.count(n) for n in "abcd") <= 3, firsts  # ... and the load bound still spreads them


def test_at_low_load_the_bound_leaves_a_conversation_where_it_is():
    """One sequence in a 4-replica fleet: the bound ((1 + 1) / 4 x 1.25, rounded up: 1 per replica)
    would push the next turn off its holder; it allows one more than the mean, so the turn stays."""
    router, now = make_router(cost_model="cpu-smollm2"), time.time()
    reps = [replica("holder", now, running=1, context_tokens=600)] + [replica(n, now) for n in "bcd"]
    router.index.insert("holder", blocks(SYSTEM + [1]))
    best = router.score(reps, router.prepare(request(SYSTEM + [5, 6, 7])), now)[0]
    assert best.replica == "holder" and not best.over_bound
    # ... while a holder above both the ratio and the mean + 1 is over the bound (on a CPU, where
    # every sequence slows a step: its free batch is 1).
    reps[0] = replica("holder", now, running=3, context_tokens=1800)
    assert router.score(reps, router.prepare(request(SYSTEM + [5, 6, 7])), now)[0].replica != "holder"


@pytest.mark.parametrize("window_s, stays", [(30.0, True), (0.0, False)])
def test_a_lull_does_not_push_a_conversation_off_its_holder(window_s, stays):
    """16 sequences on 4 replicas a few seconds ago; now, at the end of a wave, 3 are left, all on
    the holder of this conversation. Counted now, the bound (mean 1, at most 2) moves the turn, and
    it recomputes the whole conversation elsewhere; counted over the window (mean 4), it stays."""
    router, now = make_router(load_window_s=window_s), time.time()
    busy = [replica(n, now - 5, running=4, context_tokens=4 * 600) for n in ("holder", "b", "c", "d")]
    router.score(busy, router.prepare(request([1, 2, 3])), now - 5)
    lull = [replica("holder", now, running=3, context_tokens=3 * 600)] + [replica(n, now) for n in "bcd"]
    conversation = SYSTEM + list(range(2000, 3200))
    router.index.insert("holder", blocks(conversation))
    best = router.score(lull, router.prepare(request(conversation + [5, 6, 7])), now)[0]
    assert (best.replica == "holder") == stays, best
