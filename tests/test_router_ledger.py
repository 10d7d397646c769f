"""What LLMRouter knows of each request (router.ledger, router.index) from its decision to its answer,
with fake replicas (no Ray cluster): pending prefix claims, Serve's confirmations and retries, the
bounds, answers, and replicas that go away."""

from __future__ import annotations

import time

import pytest

from batcher.block_hash import root_hash, routing_key
from router.config import LLMRouterConfig
from router.index import PrefixIndex
from router.ledger import HashedRequest, RequestLedger
from router.scoring import RoutingRequest
from tests.router_harness import BS, MODEL, SYSTEM, blocks, make_router, replica, request


def hashed(ids, request_id=None) -> HashedRequest:
    return HashedRequest(request_id, root_hash(MODEL), blocks(ids), RoutingRequest(len(ids), 16))


def test_serve_sending_a_request_elsewhere_leaves_no_prefix_on_the_first_choice(serving):
    """The decision claims the prompt's blocks on its first choice before Serve confirms it (so a burst
    follows it); Serve may send the request to another candidate (the first was full): then only that
    replica holds the prefix, and the request counts there alone."""
    router, now = make_router(), time.time()
    serve = serving(router, [replica(n, now) for n in "abcd"])
    req = request(SYSTEM + [5, 6, 7], "u1")
    first, second = serve.choose(req, "k1")[:2]
    hashes = router.prepare(req).hashes
    assert router.index.matched_blocks(hashes) == {first: 50}
    serve.confirm("k1", second)
    assert router.index.matched_blocks(hashes) == {second: 50}
    assert [len(router.ledger.inflight(n)) for n in (first, second)] == [0, 1]


def test_a_request_decided_again_counts_once_and_leaves_nothing_behind(serving):
    """Serve asks again for a request it could not place yet (backoff): the request neither counts twice
    nor is drawn back by its own claim (on an idle fleet every replica stays as likely), and wherever
    Serve sends it in the end, no claim stays on the replicas chosen before."""
    router, now = make_router(), time.time()
    serve = serving(router, [replica(n, now) for n in "abcd"])
    req = request(SYSTEM + [5, 6, 7], "u1")
    firsts = {serve.choose(req, "k1")[0] for _ in range(20)}
    assert len(firsts) > 1, firsts
    assert sum(len(router.ledger.inflight(n)) for n in "abcd") == 1 and router.ledger.num_requests() == 1
    last = serve.choose(req, "k1")[0]
    elsewhere = next(n for n in "abcd" if n != last)
    serve.confirm("k1", elsewhere)
    assert router.index.matched_blocks(router.prepare(req).hashes) == {elsewhere: 50}


def test_releasing_a_claim_keeps_blocks_other_requests_claimed_or_cached():
    """Two requests of a burst share a system prompt and claim it on "a"; Serve sends the first to "b":
    "a" keeps the prefix the second still claims. Once the second is confirmed on "a", a third request
    claiming and leaving "a" takes nothing cached there away."""
    index = PrefixIndex(10_000)
    ledger = RequestLedger(index, max_requests=100)
    one, two, three = (hashed(SYSTEM + [i] * 16) for i in (1, 2, 3))
    now = time.time()
    ledger.chosen("k1", "a", one, 0, now)
    ledger.chosen("k2", "a", two, 0, now)
    ledger.routed("k1", "b", cached_tokens=0, now=now)
    assert index.matched_blocks(one.hashes) == {"b": 51, "a": 50}  # "a": the shared 400 tokens (k2's claim)
    assert index.matched_blocks(two.hashes) == {"a": 51, "b": 50}
    ledger.routed("k2", "a", cached_tokens=None, now=now)
    ledger.chosen("k3", "a", three, 0, now)
    ledger.routed("k3", "b", cached_tokens=0, now=now)
    assert index.matched_blocks(two.hashes) == {"a": 51, "b": 50}
    assert index.matched_blocks(three.hashes) == {"b": 51, "a": 50}
    assert index.num_claimed("a") == index.num_claimed("b") == 0


def test_a_confirmed_claim_becomes_exactly_what_insert_then_release_leave():
    """`confirm` is `insert` then `release` in one pass: the same blocks, owners, LRU order and claims,
    with another request's claim on the shared prefix kept and a block cached before only refreshed."""
    one, two = hashed(SYSTEM + [1] * 16), hashed(SYSTEM + [2] * 16)
    indexes = [PrefixIndex(40), PrefixIndex(40)]  # room for less than one chain: it evicts too
    for index in indexes:
        index.insert("a", two.hashes[:10])
        index.claim("a", one.hashes)
        index.claim("a", two.hashes)
    indexes[0].confirm("a", one.hashes)
    indexes[1].insert("a", one.hashes)
    indexes[1].release("a", one.hashes)
    (x, y) = indexes
    assert list(x._blocks["a"]) == list(y._blocks["a"])
    assert x._claims == y._claims and x._owners == y._owners
    assert x.matched_blocks(two.hashes) == {"a": 51}  # still claimed by two: whole chain owned


def test_a_rejected_attempt_releases_its_claim_and_the_retry_counts_once():
    """A replica rejects the request (full): Serve reports it completed there before any confirmation,
    then routes it again. Nothing stays on the replica that rejected it."""
    index = PrefixIndex(10_000)
    ledger = RequestLedger(index, max_requests=100)
    req, now = hashed(SYSTEM + [1], "u1"), time.time()
    ledger.chosen("k", "a", req, 0, now)
    ledger.completed_on("k", "a", now)
    assert index.matched_blocks(req.hashes) == {} and not ledger.inflight("a") and not ledger.completed("a")
    assert ledger.take_back("k") == req  # the retry's decision
    ledger.chosen("k", "b", req, 0, now)
    ledger.completed_on("k", "a", now)  # a late word about the rejected attempt: not this one's
    ledger.routed("k", "b", cached_tokens=None, now=now)
    assert index.matched_blocks(req.hashes) == {"b": 50} and len(ledger.inflight("b")) == 1
    assert ledger.answered("u1") == ("b", req)


def test_a_request_completed_before_its_confirmation_is_cached_but_not_in_flight():
    """A short request can end before Serve's confirmation reaches the router: its blocks are cached
    where Serve confirms it, and it does not count in flight for ever after."""
    index = PrefixIndex(10_000)
    ledger = RequestLedger(index, max_requests=100)
    req, now = hashed(SYSTEM + [1], "u1"), time.time()
    ledger.chosen("k", "a", req, 0, now)
    ledger.completed_on("k", "a", now)
    ledger.routed("k", "a", cached_tokens=0, now=now)
    assert index.matched_blocks(req.hashes) == {"a": 50} and not ledger.inflight("a")
    assert ledger.num_requests() == 0 and ledger.answered("u1") == ("a", req)


def test_the_bounds_forget_requests_oldest_first_and_release_their_claims():
    index = PrefixIndex(10_000)
    ledger = RequestLedger(index, max_requests=2, forget_after_s=60, answer_wait_s=30)
    reqs = [hashed([i] * 40, f"u{i}") for i in range(4)]
    now = time.time()
    for i in range(3):  # by count: the third forgets the first (never confirmed: cancelled while queued)
        ledger.chosen(f"k{i}", "a", reqs[i], 0, now + i)
    assert ledger.num_requests() == 2 and len(ledger.inflight("a")) == 2
    assert index.matched_blocks(reqs[0].hashes) == {} and index.matched_blocks(reqs[1].hashes) == {"a": 4}
    ledger.routed("k1", "a", None, now + 3)
    ledger.chosen("k3", "a", reqs[3], 0, now + 100)  # by age: k2 (chosen at now + 2) is forgotten
    assert ledger.replica_of("k2") is None and index.matched_blocks(reqs[2].hashes) == {}
    assert index.matched_blocks(reqs[1].hashes) == {"a": 4}  # confirmed: cached, whatever the ledger forgets
    assert ledger.num_awaiting() == 0  # k1's answer, awaited since now + 3, was not expected that late


def test_a_claimed_block_stays_owned_while_the_lru_evicts_its_cached_copy():
    index = PrefixIndex(max_blocks_per_replica=10)
    claimed, other = blocks(list(range(81))), blocks(list(range(500, 581)))
    index.insert("r", claimed)
    index.claim("r", claimed)
    index.insert("r", other)  # evicts the cached copy of `claimed`
    assert index.matched_blocks(claimed) == {"r": 10} and index.num_blocks("r") == 10
    index.release("r", claimed)
    assert index.matched_blocks(claimed) == {}


def test_an_index_of_one_block_in_four_matches_to_within_four_blocks():
    """Every fourth block of a chain is kept (each names its whole prefix): matches are multiples of
    four blocks, claims and bounds count kept blocks, and evictions of blocks it never kept change
    nothing."""
    index = PrefixIndex(max_blocks_per_replica=1000, stride=4)
    chain = blocks(SYSTEM + [1] * 8)  # 51 blocks
    index.insert("a", chain)
    assert index.matched_blocks(chain) == {"a": 48} and index.num_blocks("a") == 12
    assert index.matched_blocks(blocks(SYSTEM[:240] + [9] * 80)) == {"a": 28}  # shares 30 blocks
    assert index.matched_blocks(chain[:3]) == {}  # shorter than a stride: nothing kept to match
    other = blocks(SYSTEM[:160] + [2] * 40)  # 25 blocks, 20 shared
    index.claim("b", other)
    assert index.matched_blocks(other) == {"a": 20, "b": 24} and index.num_claimed("b") == 6
    index.release("b", other)
    assert index.matched_blocks(other) == {"a": 20} and index.num_claimed("b") == 0
    assert index.forget("a", [routing_key(chain[45])]) == 0  # never kept: the match stays
    assert index.forget("a", [routing_key(chain[47])]) == 1 and index.matched_blocks(chain) == {"a": 44}
    bounded = PrefixIndex(max_blocks_per_replica=40, stride=4)  # 40 blocks: 10 kept
    bounded.insert("a", chain)
    assert bounded.matched_blocks(chain) == {"a": 40}
    bounded.set_capacity("a", kv_blocks=20)
    assert bounded.matched_blocks(chain) == {"a": 20} and bounded.num_blocks("a") == 5


def test_index_is_bounded_and_evicts_tails_before_roots():
    index = PrefixIndex(max_blocks_per_replica=100)
    for user in range(20):
        index.insert("r", blocks(SYSTEM + [user] * 200))
    assert index.num_blocks("r") == 100
    # The shared system prompt (the roots, most recently touched) survived the eviction.
    assert index.matched_blocks(blocks(SYSTEM + [99])) == {"r": 50}
    index.set_capacity("r", kv_blocks=30)  # the replica reports a smaller KV cache: the index follows
    assert index.num_blocks("r") == 30
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_requests_with_another_cache_salt_match_no_blocks():
    """The router hashes as the replicas do: from the model and the request's cache salt."""
    router = make_router()
    router.index.insert("a", blocks(SYSTEM + [1], cache_salt="tenant-1"))

    def matched(salt):
        return router.index.matched_blocks(router.prepare(request(SYSTEM + [5], cache_salt=salt)).hashes)

    assert matched("tenant-1") == {"a": 50} and matched("tenant-2") == {} and matched(None) == {}
    router.index.insert("b", blocks(SYSTEM + [1]))
    assert matched(None) == {"b": 50}


@pytest.mark.parametrize("stride_tokens", [BS, LLMRouterConfig.model_fields["index_stride_tokens"].default])
def test_turn_two_follows_turn_one_including_its_answer(serving, stride_tokens):
    """With an index of every block, and of one block in four (the default): matched to within it."""
    router, now = make_router(index_stride_tokens=stride_tokens), time.time()
    stride = stride_tokens // BS
    reps = [replica(n, now) for n in "abcd"]
    serve = serving(router, reps)
    turn1 = list(range(2000, 2100))
    first = serve.route(request(turn1, "t1"), "k1")
    answer = list(range(5000, 5120))
    serve.complete("k1", first)
    router.record_answer("t1", turn1, answer)
    on_first = router.index.matched_blocks(blocks(turn1 + answer + [7, 8, 9]))[first]
    computed = len(turn1) + len(answer) - 1  # the answer's last token is sampled, never computed
    assert on_first == computed // BS // stride * stride  # the answer's blocks count as cached
    # Other replicas got busier meanwhile; turn 2 still goes where turn 1 was computed.
    for r in reps:
        if r.replica_id.unique_id != first:
            r.routing_stats.update(running=4, context_tokens=800)
    second = router.score(reps, router.prepare(request(turn1 + answer + [7, 8, 9], "t2")), now)[0]
    assert second.replica == first and second.cached_tokens == computed // BS // stride * stride * BS


@pytest.mark.parametrize("how", ["actor died", "left the replica set"])
def test_a_replica_that_goes_away_leaves_nothing_behind(serving, how):
    """Everything about replica "a" goes with it: requests in flight and completed, its report, its
    blocks and claims, answers awaited from it; Serve's late word about it counts nothing there."""
    router, now = make_router(), time.time()
    reps = [replica(n, now) for n in "ab"]
    serve = serving(router, reps)
    serve.route(request(SYSTEM + [1], "done"), "k-done", to="a")
    serve.complete("k-done", "a")
    serve.route(request(SYSTEM + [2], "running"), "k-running", to="a")
    serve.choose(request(SYSTEM + [3], "late"), "k-late")  # Serve has not confirmed it yet
    router.score(reps, router.prepare(request([1, 2, 3])))  # reads both reports
    assert router.ledger.inflight("a") and router.ledger.completed("a") and "a" in router._reports
    if how == "actor died":
        router.on_replica_actor_died(serve.id("a"))
    else:
        serve.update([reps[1]])
    gone = lambda: (
        "a" not in router.ledger.replicas() | set(router.index.replicas()) | set(router._reports)
        and not router.ledger.inflight("a")
        and not router.ledger.completed("a")
    )
    assert gone() and router.ledger.num_awaiting() == 0
    serve.confirm("k-late", "a")  # Serve's confirmation, sent before it learnt of the death
    serve.complete("k-running", "a")
    router.record_answer("done", SYSTEM + [1], list(range(64)))
    assert gone() and router.ledger.num_requests() == 0
    assert serve.route(request(SYSTEM + [4], "after"), "k-after") == "b"
    assert len(router.ledger.inflight("b")) == 1 and router.index.replicas() == ["b"]


def test_the_index_adds_no_garbage_collected_object_per_block():
    """A full pass of Python's collector walks every tracked object: with a set of owners per block,
    an index of 640,000 blocks stopped the ingress (its routing and streams) ~150 ms each time."""
    import gc
    import hashlib

    index = PrefixIndex(50_000)
    chains = [[hashlib.sha256(b"%d-%d" % (c, i)).digest() for i in range(100)] for c in range(200)]
    gc.collect()
    before = len(gc.get_objects())
    for c, chain in enumerate(chains):
        index.insert(f"r{c % 4}", chain)  # 20,000 blocks on 4 replicas
        index.claim(f"r{(c + 1) % 4}", chain[:50])  # and claims of them elsewhere
    gc.collect()
    assert sum(index.num_blocks(f"r{k}") for k in range(4)) == 20_000
    assert len(gc.get_objects()) - before < 100
    assert index.matched_blocks(chains[5]) == {"r1": 100, "r2": 50}


def test_a_removed_replicas_bit_goes_to_the_next_replica_without_its_blocks():
    index = PrefixIndex(1000)
    a, b = [bytes([1, i]) for i in range(4)], [bytes([2, i]) for i in range(4)]
    index.insert("old", a)
    index.insert("kept", a + b)
    index.remove_replicas(["old"])
    index.insert("new", b[:2])
    assert index.matched_blocks(a + b) == {"kept": 8}  # "new" holds no prefix of it: none of "old"'s blocks
    assert index.matched_blocks(b) == {"kept": 4, "new": 2}


def test_the_micro_benchmark_takes_each_request_its_whole_way_through_the_router():
    """`load_tests.router_micro` times a request's parts, from the decision to its answer: each request
    must take the whole way (confirmed where it was decided, its answer awaited no more, prompt and
    answer cached there), or the figures time less than an ingress does."""
    from load_tests.router_micro import ANSWER, PARTS, fake_fleet, time_requests
    from load_tests.router_micro import make_router as micro_router

    router = micro_router()
    fleet = fake_fleet(router, 3, 400)
    prompts = [list(range(7000, 7400)) + [d] * 40 for d in range(6)]
    seconds = time_requests(router, fleet, prompts)
    assert list(seconds) == list(PARTS) and all(len(xs) == len(prompts) for xs in seconds.values())
    assert router.ledger.num_awaiting() == 0
    stride = router.index.stride  # the default's: one block in four
    for ids in prompts:
        chain = router.prepare(request(ids + ANSWER)).hashes  # the micro's model and block size
        assert max(router.index.matched_blocks(chain).values()) == len(chain) // stride * stride
