"""The replicas' evictions reaching the router: the engine's eviction log (batcher.eviction_log), the
router's feed (router.eviction_feed) and its prefix index, against the engine's own cache."""

from __future__ import annotations

import time

import pytest

from batcher.block_hash import routing_key
from batcher.eviction_log import EvictionLog
from router.eviction_feed import EvictionFeed
from router.index import PrefixIndex
from tests.block_ops import random_operations
from tests.router_harness import SYSTEM, blocks, make_router, replica, request


def joined(hashes) -> bytes:
    """A report's segment: the hashes' routing keys."""
    return b"".join(map(routing_key, hashes))


def cached_keys(bm, stride: int = 1) -> set:
    """The routing keys of the engine's cached blocks an index of `stride` keeps."""
    return {routing_key(h) for h, b in bm.hash_to_block.items() if bm.blocks[b].position % stride == stride - 1}


@pytest.mark.parametrize("stride", [1, 3])
@pytest.mark.parametrize("seed", range(12))
def test_an_index_fed_the_evictions_holds_exactly_what_the_engine_caches(seed, stride):
    """Random admissions, steps, preemptions and frees on a real BlockManager. Two routers' indexes
    learn every block the engine caches; one reads every report, the other one in two (a report
    repeats the last two segments). After each read, each holds exactly the engine's cached blocks,
    and the engine keeps every cached block's prefix cached (the index's prefix property). With
    indexes of one block in three and the engine logging only those (deployments.app), the same for
    the blocks they keep."""
    every, some = PrefixIndex(10**6, stride), PrefixIndex(10**6, stride)
    feeds = EvictionFeed(every), EvictionFeed(some)
    parents, reports, checked = {}, 0, 0
    for bm, live in random_operations(seed, steps=600, eviction_stride=stride):
        for s in live:  # what routers learn: each sequence's cached chain (confirmations, answers)
            every.insert("r", s.block_hashes)
            some.insert("r", s.block_hashes)
            parents.update(zip(s.block_hashes[1:], s.block_hashes))
        if (reports := reports + 1) % 3:
            continue
        report = {"evicted": bm.evictions.cut()}
        feeds[0].read("r", report)
        assert set(every._blocks.get("r", ())) == cached_keys(bm, stride)
        if reports % 6 == 0:
            feeds[1].read("r", report)
            assert set(some._blocks.get("r", ())) == cached_keys(bm, stride)
            checked += 1
        assert all(parents[h] in bm.hash_to_block for h in bm.hash_to_block if h in parents)
    assert checked >= 30 and feeds[0].dropped > 0 and feeds[0].gaps == feeds[1].gaps == 0


def test_the_log_numbers_segments_keeps_the_last_few_and_bounds_itself():
    log = EvictionLog(keep_segments=2, max_hashes=3)
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    a8, b8, c8, d8 = map(routing_key, (a, b, c, d))
    log.evicted(a, 0)
    log.evicted(b, 1)
    assert log.cut() == [(1, a8 + b8, 0)]
    log.cached(a)  # cached again: a later reader of segment 1 must not drop it
    log.evicted(c, 2)
    assert log.cut() == [(1, b8, 0), (2, c8, 0)]
    assert log.cut() == [(2, c8, 0), (3, b"", 0)]
    for i, h in enumerate((a, b, c, d)):  # a fourth hash over max_hashes: the oldest goes, counted where it was
        log.evicted(h, i)
    assert log.cut() == [(3, b"", 0), (4, b8 + c8 + d8, 1)]
    halves = EvictionLog(stride=2)  # only blocks 1, 3, 5, ... of a chain: what an index of one in two keeps
    for i, h in enumerate((a, b, c, d)):
        halves.evicted(h, i)
    assert halves.cut() == [(1, b8 + d8, 0)]


def test_blocks_a_replica_reports_evicted_leave_the_routers_index(serving):
    now = time.time()
    router = make_router()
    s = serving(router, [replica("a", now), replica("b", now)])
    conversation = SYSTEM + list(range(1, 41))  # 55 blocks
    chain = blocks(conversation)
    where = s.route(request(conversation), "k1")
    other = "b" if where == "a" else "a"
    assert router.index.matched_blocks(chain) == {where: len(chain)}
    # The replica evicted the conversation's tail (the engine evicts tails first).
    evicted = [(1, joined(chain[30:]), 0)]
    s.update([replica(where, now, evicted=evicted), replica(other, now)])
    assert router.index.matched_blocks(chain) == {where: 30}
    assert router.evictions.dropped == len(chain) - 30
    # The same report again, after the conversation's next turn cached its chain there again: no effect.
    router.index.insert(where, chain)
    s.update([replica(where, now, evicted=evicted), replica(other, now)])
    assert router.index.matched_blocks(chain) == {where: len(chain)}
    # A later report repeats segment 1 and adds segment 2: only segment 2 is applied.
    s.update([replica(where, now, evicted=evicted + [(2, joined(chain[50:]), 0)]), replica(other, now)])
    assert router.index.matched_blocks(chain) == {where: 50}
    assert router.evictions.gaps == 0
    # Segments 3-4 were never seen (more reports went by than one repeats): counted as a gap.
    s.update([replica(where, now, evicted=[(5, joined(chain[40:]), 0)]), replica(other, now)])
    assert router.index.matched_blocks(chain) == {where: 40} and router.evictions.gaps == 1


def test_claimed_blocks_stay_until_their_request_is_confirmed(serving):
    """A request decided but not yet confirmed claims its chain: the replica will compute it, so an
    eviction reported meanwhile does not take it from the next request of the burst."""
    now = time.time()
    router = make_router()
    s = serving(router, [replica("a", now), replica("b", now)])
    prompt = SYSTEM + [7] * 40
    chain = blocks(prompt)
    where = s.choose(request(prompt), "k1")[0]
    other = "b" if where == "a" else "a"
    s.update([replica(where, now, evicted=[(1, joined(chain), 0)]), replica(other, now)])
    assert router.index.matched_blocks(chain) == {where: len(chain)}


def test_with_follow_evictions_off_the_index_keeps_its_own_guess(serving):
    now = time.time()
    router = make_router(follow_evictions=False)
    s = serving(router, [replica("a", now), replica("b", now)])
    chain = blocks(SYSTEM)
    where = s.route(request(SYSTEM), "k1")
    s.update([replica(where, now, evicted=[(1, joined(chain), 0)]), replica("b" if where == "a" else "a", now)])
    assert router.index.matched_blocks(chain) == {where: len(chain)} and router.evictions.dropped == 0


@pytest.mark.parametrize("stride", [1, 4])
def test_at_fleet_churn_every_evicted_block_reaches_the_router_through_broadcasts(stride):
    """`load_tests.eviction_micro`'s loop, small: replicas evicting 200 blocks a second, reporting
    every 0.5 s at staggered times, broadcast at each controller tick with news. The router's feed
    drops every block evicted before each replica's last report (nothing missed, no gap), and a
    report carries two segments of 8-byte keys; with an index of one block in four and replicas
    logging only those, a quarter of both."""
    from load_tests.eviction_micro import measure

    r, _ = measure(replicas=3, evicted_per_s=200, kv_blocks=640, period_s=0.5, seconds=3, stride=stride)
    assert r["gaps"] == 0
    # Replica i last reported at 2.5 + 0.5 * i / 3 s, so it had evicted up to ~(that + a tick) x 200.
    last_cut = [2.5 + 0.5 * i / 3 for i in range(3)]
    expected = sum(200 * (round(t / 0.1) + 1) * 0.1 for t in last_cut) / stride
    assert r["dropped_per_s"] * 3 == pytest.approx(expected, abs=3 * 20 / stride)
    # Two half-second segments (and the pickled report's few dozen bytes around them).
    assert r["report_bytes_p50"] == pytest.approx(2 * 100 * 8 / stride + 60, rel=0.15)
