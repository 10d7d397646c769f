"""The load bound (router.load_bound): sequences that barely slow a step are not load, unless the
replica has been taking more than its share of requests; the window that judges both."""

from __future__ import annotations

import time

from batcher.simulated import PRESETS
from router.load_bound import LoadWindow, bounded_load, free_batch
from tests.router_harness import SYSTEM, blocks, make_router, replica, request

H100, CPU = PRESETS["h100-llama3-8b"].step, PRESETS["cpu-smollm2"].step


def test_the_free_batch_is_what_steps_within_a_tenth_of_one_sequence():
    free = int(free_batch(H100, 403))
    assert free == 11 and free_batch(CPU, 403) == 1 and free_batch(H100, 6000) == 3
    lone = H100.step_seconds(0, 1, 403)
    assert H100.step_seconds(0, free, free * 403) <= 1.1 * lone < H100.step_seconds(0, free + 1, (free + 1) * 403)
    assert (bounded_load(3, 4, 1.25), bounded_load(15, 4, 1.25), bounded_load(79, 4, 1.25)) == (2, 5, 25)


def test_the_window_forgets_what_is_older_than_it():
    window = LoadWindow(30.0)
    for t, rid in ((0.0, "a"), (1.0, "a"), (20.0, "b"), (25.0, "a")):
        window.routed(t, rid)
    assert list(window.recent_routes(29.0, ["a", "b", "c"])) == [3, 1, 0]
    assert list(window.recent_routes(49.5, ["a", "b", "c"])) == [1, 1, 0]  # 0 and 1 s gone, 20 s kept
    assert window.recent_routes(60.0, ["a"]) is not None and LoadWindow(0.0).recent_routes(1.0, ["a"]) is None
    assert (window.peak(0.0, 8), window.peak(10.0, 3), window.peak(40.0, 2)) == (8, 8, 3)


def test_a_gpu_holder_keeps_its_conversation_while_its_share_is_fair():
    """An H100 steps 11 sequences of ~400 tokens within 10% of one: at a fleet mean of one sequence,
    a holder running 3 (above the bound's 2) keeps the turn, as long as it has not been sent more
    than its share of the recent requests; a holder that has is bound as before."""

    def reps(now, running):
        return [replica("holder", now, running=running, context_tokens=running * 600)] + [
            replica(n, now) for n in "bcd"
        ]

    for recent, stays in (({"holder": 2, "b": 2, "c": 1, "d": 2}, True), ({"holder": 7}, False)):
        router, now = make_router(), time.time()
        router.index.insert("holder", blocks(SYSTEM + [1]))
        for rid, n in recent.items():
            for _ in range(n):
                router.window.routed(now - 1, rid)
        best = router.score(reps(now, 3), router.prepare(request(SYSTEM + [5, 6, 7])), now)[0]
        assert (best.replica == "holder") == stays, (recent, best)
    # Beyond the free batch the bound holds whatever the share.
    router, now = make_router(), time.time()
    router.index.insert("holder", blocks(SYSTEM + [1]))
    assert router.score(reps(now, 11), router.prepare(request(SYSTEM + [5, 6, 7])), now)[0].replica != "holder"


def test_a_hot_prompts_first_turns_spread_though_the_gpu_batch_is_free(serving):
    """16 users of one system prompt arrive together (all in flight): each sequence is nearly free on
    an H100, so only the share keeps the prompt's holder from taking them all (and their
    conversations, which then fill its KV cache between turns)."""
    router, now = make_router(), time.time()
    serve = serving(router, [replica(n, now, age_s=0.01) for n in "abcd"])
    chosen = [serve.route(request(SYSTEM + [7000 + i], f"u{i}"), f"k{i}") for i in range(16)]
    counts = sorted(chosen.count(n) for n in "abcd")
    assert counts[-1] <= bounded_load(15, 4, 1.25) and counts[0] >= 1, chosen
    # Asked again for the same request (Serve's backoff), the window counts it once.
    serve.choose(request(SYSTEM + [7000], "u0"), "k0")
    assert router.window.recent_routes(time.time(), ["a", "b", "c", "d"]).sum() == 16


def test_new_prompts_on_an_idle_fleet_go_to_replicas_not_just_sent_one(serving):
    """Four system prompts' first turns, one after another, each finished before the next: the idle
    replicas score the same, and the window's routes break the tie, so each prompt gets its own
    replica (at random, nine fleets in ten would hold two prompts on one replica and none on another)."""
    for attempt in range(3):
        router, now = make_router(), time.time()
        serve = serving(router, [replica(n, now, age_s=0.01) for n in "abcd"])
        chosen = []
        for p in range(4):
            key = f"{attempt}:{p}"
            chosen.append(serve.route(request([5000 + 1000 * p + i for i in range(400)] + [1], key), key))
            serve.complete(key, chosen[-1])
        assert sorted(chosen) == ["a", "b", "c", "d"], chosen
