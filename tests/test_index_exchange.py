"""Routers of one deployment sharing what they learn (router.index_exchange, router.index_sync): the
exchange's log in plain Python, the board's long poll and subscriptions, and LLMRouter's side of it
with fake replicas (no Ray cluster; the real actor between two callers: tests/test_router_serve.py):
where prefixes are cached, and the requests each router has just sent, which the others count as
load until the replica's reports do."""

from __future__ import annotations

import asyncio
import time

from conftest import eventually

from batcher.block_hash import ROUTING_KEY_BYTES, routing_key
from router.index_exchange import ExchangeBoard, IndexExchange, pack, unpack
from router.index_sync import ANSWER_DELAY_S, IndexSync
from router.ledger import FOREIGN_GRACE_S
from router.scoring import Routed
from tests.router_harness import SYSTEM, blocks, make_router, replica, request

H = [bytes([i]) * 32 for i in range(8)]  # stand-in block hashes
K = [routing_key(h) for h in H]  # what crosses the exchange of each


def test_each_router_gets_the_others_entries_not_its_own_and_a_new_one_gets_the_log():
    ex = IndexExchange()
    assert ex.push("a", [pack("r1", K[:2])]) is False  # alone so far
    cursor_b, news, others = ex.pull("b", None)  # new: all the log holds
    assert news == [pack("r1", K[:2])] and others is True
    cursor_a, news, _ = ex.pull("a", None)
    assert news == []  # a's own entries never come back
    sent = Routed(1.0, 400, 400, "q1")
    assert ex.push("a", [pack("r2", K[2:3], sent)]) is True  # b was heard from
    cursor_b, news, _ = ex.pull("b", cursor_b)
    assert [unpack(e) for e in news] == [("r2", K[2:3], sent, None)]
    assert ex.pull("b", cursor_b)[1] == []  # nothing new since b's cursor


def test_entries_cross_as_builtins_with_the_routers_package_pickled_by_value():
    """Serve registers the request router's module (`router`) with cloudpickle by value, in every
    process that routes; a Routed in an entry crossed with its class's whole definition, every push
    and pull (5.7 KB for four hashes). Packed, an entry is its blocks' routing keys (8 of a hash's 32
    bytes: all the index keeps) and a few fields."""
    from ray import cloudpickle

    import router

    entries = [pack("r1", K[:4], Routed(1.0, 400, 300, "q1")), pack("r2", K[4:6], None, "q1")]
    cloudpickle.register_pickle_by_value(router)
    try:
        size = len(cloudpickle.dumps(entries))
    finally:
        cloudpickle.unregister_pickle_by_value(router)
    assert [len(e[1]) for e in entries] == [4 * ROUTING_KEY_BYTES, 2 * ROUTING_KEY_BYTES]
    assert size < 6 * ROUTING_KEY_BYTES + 200, size
    assert [unpack(e)[:3] for e in entries] == [("r1", K[:4], Routed(1.0, 400, 300, "q1")), ("r2", K[4:6], None)]


def test_the_log_is_bounded_and_a_router_alone_is_told_so():
    ex = IndexExchange(max_hashes=4, max_entries=10, alone_after_s=0.05)
    ex.push("a", [pack("r1", K[0:2]), pack("r1", K[2:4]), pack("r2", K[4:6])])
    assert ex.pull("b", None)[1] == [pack("r1", K[2:4]), pack("r2", K[4:6])]  # the oldest chain went
    ex = IndexExchange(max_entries=2)
    ex.push("a", [pack("r1", [], Routed(t, 10, 10, str(t))) for t in range(3)])
    assert [unpack(e)[2].request_id for e in ex.pull("b", None)[1]] == ["1", "2"]  # sends count against the bound too
    ex = IndexExchange(alone_after_s=0.05)
    ex.pull("b", None)
    time.sleep(0.06)
    assert ex.push("a", []) is False  # b has not been heard from within alone_after_s: a need not push


def test_the_boards_long_poll_returns_when_another_router_pushes_and_keeps_deployments_apart():
    async def main():
        board = ExchangeBoard()
        await board.pull("app/LLMServer", "b", None, 0)  # b is known: a's pushes are kept
        t0 = time.monotonic()
        # A wait far longer than a loaded machine's delays: returning before it ends is the push's doing.
        waiting = asyncio.create_task(board.pull("app/LLMServer", "b", 0, 60.0))
        other = asyncio.create_task(board.pull("other/LLMServer", "c", 0, 0.3))
        await asyncio.sleep(0.05)
        await board.push("app/LLMServer", "b", [pack("r9", K[:1])])  # b's own push: b keeps waiting
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await board.push("app/LLMServer", "a", [pack("r1", K[:2])])
        _, news, others = await asyncio.wait_for(waiting, 30.0)
        woke = time.monotonic() - t0
        assert news == [pack("r1", K[:2])] and others is True and woke < 30.0
        assert (await other)[1] == []  # another deployment's push is not its news: empty after its wait
        stats = (await board.stats())["deployments"]["app/LLMServer"]
        assert stats["entries_in"] == 2 and stats["hashes_out"] == 2 and stats["pulls"] == 2  # b's two calls

    asyncio.run(main())


def test_a_subscription_sends_each_push_as_it_comes_nothing_after_its_wait_and_ends_after_its_lifetime():
    """What a router's subscription streams: the others' news as soon as one pushes (in one batch,
    whatever came meanwhile), an empty batch after each wait with nothing, its own pushes never; it
    ends after its lifetime, so one whose router went without a word does not stay open."""

    async def main():
        board, batches = ExchangeBoard(), []
        await board.pull("app/LLMServer", "b", None, 0)  # b is known: a's pushes are kept

        async def listen():
            async for _cursor, news, _others in board.subscribe("app/LLMServer", "b", 0, WAIT_S, lifetime_s=LIFE_S):
                batches.append((time.monotonic(), news))

        listening = asyncio.create_task(listen())
        await asyncio.sleep(0.05)
        await board.push("app/LLMServer", "b", [pack("r9", K[:1])])  # b's own: nothing to send it
        pushed = [time.monotonic()]
        await board.push("app/LLMServer", "a", [pack("r1", K[:2])])
        await asyncio.sleep(0.1)
        pushed.append(time.monotonic())
        await board.push("app/LLMServer", "a", [pack("r2", K[2:3]), pack("r3", K[3:4])])
        await asyncio.wait_for(listening, 30.0)
        return pushed, batches

    # Pushed 0.05 s and 0.15 s in, a wait of 2 s: the lifetime ends within the wait after the second
    # push's batch (one empty batch, then ended) unless the machine stalls for most of 2 s.
    WAIT_S, LIFE_S = 2.0, 2.1
    pushed, batches = asyncio.run(main())
    assert [news for _, news in batches[:2]] == [[pack("r1", K[:2])], [pack("r2", K[2:3]), pack("r3", K[3:4])]]
    lags = [batches[i][0] - pushed[i] for i in range(2)]
    assert max(lags) < WAIT_S, (lags, batches)  # each sent at once, not after the wait
    assert all(news == [] for _, news in batches[2:]) and 1 <= len(batches) - 2 <= 2  # one a wait, then ended


class LoopBoard:
    """ExchangeBoard's interface over one in-process IndexExchange, for routers on loops of their own
    (the test's Serving): with nothing new, the subscription looks again after a short sleep instead
    of waiting for a push."""

    def __init__(self):
        self.exchange = IndexExchange()

    async def push(self, deployment, router, entries):
        return self.exchange.push(router, entries)

    async def subscribe(self, deployment, router, cursor, wait_s):
        while True:
            cursor, news, others = self.exchange.pull(router, cursor)
            if news:
                yield cursor, news, others
            else:
                await asyncio.sleep(min(wait_s, 0.005))


def sharing_pair(serving, now: float, names: str = "wxyz", router_kwargs=None, **stats):
    """Two routers of one deployment sharing through a LoopBoard, each driven as Serve drives it. Each
    polls once before the other pushes (b first, then a, which hears of b: a pushes from then on)."""
    board, pairs = LoopBoard(), []
    for _ in range(2):
        router = make_router(**(router_kwargs or {}))  # sharing off: serving() starts no exchange with a cluster
        pairs.append((router, serving(router, [replica(n, now, **stats) for n in names])))
    (a, serve_a), (b, serve_b) = pairs
    for router, serve in ((b, serve_b), (a, serve_a)):
        serve.run(_start(router, board))
        serve.run(asyncio.sleep(0.02))
    return a, serve_a, b, serve_b


async def _start(router, board):
    router.sync.period_s = 0.01
    router.sync.start(router._learned_elsewhere, board)


def test_two_routers_sharing_route_a_turn_where_the_other_sent_the_last_one(serving):
    a, serve_a, b, serve_b = sharing_pair(serving, time.time())
    turn1, answer = SYSTEM + list(range(2000, 2100)), list(range(5000, 5120))
    where = serve_a.route(request(turn1, "t1"), "k1")
    serve_a.complete("k1", where)
    a.record_answer("t1", turn1, answer)
    a.sync.learned("gone", blocks(list(range(9000, 9100))))  # a replica b was never given
    serve_a.run(asyncio.sleep(ANSWER_DELAY_S + 0.05))  # a pushes (the send at once, the answer within the delay)
    serve_b.run(asyncio.sleep(0.02))  # b pulls
    turn2 = turn1 + answer + [7, 8, 9]
    answered = (len(turn1) + len(answer) - 1) // 8  # the answer's last token is never computed
    assert b.index.matched_blocks(blocks(turn2)) == {where: answered}
    assert "gone" not in b.index.replicas()
    assert serve_b.choose(request(turn2, "t2"), "k2")[0] == where  # b routes turn 2 where a sent turn 1
    # The answer's entry carried only the blocks past its prompt; b had the prompt's from a's send.
    prompt_blocks = (len(turn1) - 1) // 8
    answer_entry = next(e for _, _, e in a.sync._board.exchange._log if e[3] == "t1")
    sent_keys = [routing_key(h) for h in blocks(turn1 + answer)[prompt_blocks:answered]]
    assert unpack(answer_entry)[1] == sent_keys and answer_entry[2] is None


def test_routers_keeping_one_block_in_four_exchange_only_those(serving):
    """The default index keeps one block in four (router.index), and the entries carry only those: a
    quarter of the keys. An answer's entry starts past its prompt's 62 blocks, where a chain's kept
    blocks are 63, 67, ...: b must keep exactly the blocks a keeps, or its matches are wrong."""
    a, serve_a, b, serve_b = sharing_pair(serving, time.time(), router_kwargs={"index_stride_tokens": 32})
    turn1, answer = SYSTEM + list(range(2000, 2100)), list(range(5000, 5120))
    prompt_blocks, chain = (len(turn1) - 1) // 8, blocks(turn1 + answer)
    assert a.index.stride == 4 and prompt_blocks == 62
    where = serve_a.route(request(turn1, "t1"), "k1")
    serve_a.complete("k1", where)
    a.record_answer("t1", turn1, answer)
    serve_a.run(asyncio.sleep(ANSWER_DELAY_S + 0.05))
    serve_b.run(asyncio.sleep(0.02))
    send, reply = (e for _, _, e in a.sync._board.exchange._log)
    assert unpack(send)[1] == [routing_key(h) for h in chain[3:prompt_blocks:4]]  # blocks 3, 7, ..., 59
    assert unpack(reply)[1] == [routing_key(h) for h in chain[63::4]] and reply[3] == "t1"
    assert set(b.index._blocks[where]) == set(a.index._blocks[where])
    turn2 = turn1 + answer + [7, 8, 9]
    answered = (len(turn1) + len(answer) - 1) // 8
    assert b.index.matched_blocks(blocks(turn2)) == {where: answered // 4 * 4}


def test_a_router_counts_the_requests_another_just_sent_and_sends_its_own_elsewhere(serving):
    """Four idle replicas, reports fresh: a sends three long unique prompts (one a replica); b, which
    reads the same reports, hears of them and sends its own to the fourth. Without the sends shared,
    b sees four idle replicas (and picks one at random)."""
    now = time.time()
    a, serve_a, b, serve_b = sharing_pair(serving, now, request_ids=[])
    taken = [serve_a.route(request(list(range(10_000 * i, 10_000 * i + 4000)), f"a{i}"), f"ka{i}") for i in range(3)]
    assert len(set(taken)) == 3
    serve_a.run(asyncio.sleep(0.02))
    serve_b.run(asyncio.sleep(0.02))
    for name in taken:
        load = b.load(name, b.curr_replicas[serve_b.id(name)].routing_stats)
        assert load.batch == 1 and load.queued_prefill_tokens > 3000  # a's request, its prefill ahead
    free = ({"w", "x", "y", "z"} - set(taken)).pop()
    assert serve_b.route(request(list(range(90_000, 94_000)), "b0"), "kb0") == free


def test_a_request_the_other_router_heard_answered_stops_counting_before_any_report(serving):
    """Reports list the requests a replica holds; one that began and ended between two reports is never
    listed, so without more the other router would count it for FOREIGN_GRACE_S (1 s): a phantom
    load. Its answer, shared even when it adds no block past the prompt, ends it there at once."""
    now = time.time()
    a, serve_a, b, serve_b = sharing_pair(serving, now, request_ids=[])
    prompt = list(range(20_000, 20_401))  # 401 tokens, 50 full blocks: the last token never counts
    where = serve_a.route(request(prompt, "short"), "ks")
    serve_a.run(asyncio.sleep(0.02))
    serve_b.run(asyncio.sleep(0.02))
    stats = b.curr_replicas[serve_b.id(where)].routing_stats
    assert b.load(where, stats).batch == 1  # a's request, heard of at once
    serve_a.complete("ks", where)
    a.record_answer("short", prompt, [1, 2])  # two tokens: no block past the prompt's
    serve_a.run(asyncio.sleep(ANSWER_DELAY_S + 0.05))
    serve_b.run(asyncio.sleep(0.02))
    assert b.load(where, stats).batch == 0  # the same report: the answer alone ended it


def test_another_routers_request_counts_until_a_report_counts_it_or_shows_it_ended(serving):
    now = time.time()
    router = make_router()
    serve = serving(router, [replica(n, now, request_ids=[]) for n in "xy"])
    x = router.curr_replicas[serve.id("x")]
    base = router.load("x", x.routing_stats).batch
    router._learned_elsewhere("x", [], Routed(now, 4000, 4000, "q1"))
    router._learned_elsewhere("x", [], Routed(now, 500, 500, "q2"))
    assert router.load("x", x.routing_stats).batch == base + 2
    router._learned_elsewhere("gone", [], Routed(now, 4000, 4000, "q3"))  # not a replica of this router's
    assert router.ledger.replicas() <= {"x", "y"}
    router._learned_elsewhere("x", [], Routed(now - FOREIGN_GRACE_S - 1, 4000, 4000, "q0"))  # old: the reports'
    assert router.load("x", x.routing_stats).batch == base + 2
    # The next report counts q1 (so it is not counted twice); q2 was sent long enough before it to have
    # ended; a report that already counts a request means it is never added.
    later = dict(x.routing_stats, time_s=now + FOREIGN_GRACE_S + 0.5, running=1, request_ids=["q1"])
    assert router.load("x", later).batch == 1
    router._learned_elsewhere("x", [], Routed(now, 4000, 4000, "q1"))  # a late copy of what the report counts
    assert router.load("x", later).batch == 1
    just_sent = dict(later, time_s=now + 0.1, running=0, request_ids=[])
    router._learned_elsewhere("y", [], Routed(now, 800, 800, "q4"))
    y = router.curr_replicas[serve.id("y")]
    assert router.load("y", dict(y.routing_stats, **{k: just_sent[k] for k in ("time_s", "request_ids")})).batch == 1


def test_with_sharing_off_a_router_keeps_nothing_to_share(serving):
    router, now = make_router(share_index_s=0), time.time()
    serve = serving(router, [replica(n, now) for n in "ab"])
    serve.route(request(SYSTEM, "t1"), "k1")
    router.record_answer("t1", SYSTEM, [1, 2, 3])
    assert router.sync._outbox == [] and router.sync._task is None  # no exchange: nothing accumulates


def test_a_cancelled_call_keeps_the_boards_handle_and_a_dead_actor_drops_it():
    """The process that made the board owns it: dropping its handle ends the actor for every router.
    A call Ray cancelled (a request's child, when the request ended) must not; a dead actor's must."""
    import ray.exceptions

    from router.index_sync import _ActorBoard

    class Call:  # an actor method whose call fails with `error` (a push)
        def __init__(self, error):
            self.error = error

        def remote(self, *args):
            async def fail():
                raise self.error

            return fail()

    class Stream(Call):  # one whose streaming call fails (a subscription)
        def options(self, **kwargs):
            return self

        def remote(self, *args):
            async def fail():
                raise self.error
                yield

            return fail()

    async def subscribe(board):
        async for _ in board.subscribe("app/LLMServer", "a", None, 0.25):
            pass

    for error, kept in ((ray.exceptions.TaskCancelledError(), True), (ray.exceptions.ActorDiedError(), False)):
        for call in (lambda board: board.push("app/LLMServer", "a", []), subscribe):
            board = _ActorBoard()
            board._actor = type("Actor", (), {"push": Call(error), "subscribe": Stream(error)})()
            try:
                asyncio.run(call(board))
            except Exception:
                pass
            assert (board._actor is not None) == kept, error


def test_pushes_and_subscriptions_run_outside_the_request_that_started_them():
    """Ray counts an actor call made in a request's context as that request's child, and cancels it
    when the request ends (a streamed answer's does): IndexSync's tasks start with contexts of their own."""
    import contextvars

    request = contextvars.ContextVar("request", default=None)
    seen = []

    class Board:
        async def push(self, deployment, router, entries):
            seen.append(("push", request.get()))
            return True

        async def subscribe(self, deployment, router, cursor, wait_s):
            while True:
                seen.append(("subscription", request.get()))
                await asyncio.sleep(0.01)
                yield 0, [], True

    async def main():
        request.set("req-1")  # as in the request whose routing started the sharing
        sync = IndexSync(0.01, "app/LLMServer")
        sync.start(lambda *entry: None, Board())
        await asyncio.sleep(0.02)
        sync.learned("r1", H[:2])
        await eventually(lambda: any(kind == "push" for kind, _ in seen), 30, "the entry's push")
        sync._task.cancel()

    asyncio.run(main())
    assert ("push", None) in seen and ("subscription", None) in seen and all(ctx is None for _, ctx in seen)


def test_an_answers_entry_rides_with_the_next_send_or_goes_alone_within_the_delay():
    """A send is pushed at once; an answer's entry (no send) waits for one, up to ANSWER_DELAY_S: a
    push is an actor call, and wakes every other router's poll."""
    pushes = []

    class Board:
        async def push(self, deployment, router, entries):
            pushes.append([entry[2] is not None for entry in entries])  # which entries were sends
            return True

        async def subscribe(self, deployment, router, cursor, wait_s):
            while True:
                await asyncio.sleep(0.01)
                yield 0, [], True

    async def main():
        sync = IndexSync(0.01, "app/LLMServer")
        sync.start(lambda *entry: None, Board())
        await asyncio.sleep(0.02)
        sync.learned("r1", H[:3], extends=("q0", 1))  # q0's answer
        await asyncio.sleep(ANSWER_DELAY_S / 4)
        assert pushes == []
        sync.learned("r1", H[:4], Routed(time.time(), 32, 8, "q1"))  # a send: now, the answer with it
        await asyncio.sleep(0.02)
        assert pushes == [[False, True]]
        sync.learned("r2", H[:5], extends=("q1", 4))  # an answer, no send after it
        await asyncio.sleep(ANSWER_DELAY_S / 2)
        assert len(pushes) == 1
        await asyncio.sleep(ANSWER_DELAY_S)
        assert pushes == [[False, True], [False]]
        sync._task.cancel()

    asyncio.run(main())
