"""Routers of one deployment sharing what they learn of the replicas' caches (router.index_exchange):
the exchange's log in plain Python, and LLMRouter's side of it with fake replicas (no Ray cluster;
the real actor between two ingress replicas: tests/test_router_serve.py)."""
from __future__ import annotations

import asyncio
import time

from router.index_exchange import ExchangeBoard, IndexExchange
from tests.router_harness import SYSTEM, blocks, make_router, replica, request, serving  # noqa: F401

H = [bytes([i]) * 32 for i in range(8)]  # stand-in block hashes


def test_each_router_gets_the_others_chains_not_its_own_and_a_new_one_gets_the_log():
    ex = IndexExchange()
    cursor_a, news, others = ex.exchange("a", None, [("r1", H[:2])])
    assert news == [] and others is False  # alone so far
    cursor_b, news, others = ex.exchange("b", None, [])  # new: all the log holds
    assert news == [("r1", H[:2])] and others is True
    cursor_a, news, others = ex.exchange("a", cursor_a, [("r2", H[2:3])])
    assert news == [] and others is True  # b pushed nothing; a's own entries never come back
    cursor_b, news, _ = ex.exchange("b", cursor_b, [("r3", H[3:5])])
    assert news == [("r2", H[2:3])]
    _, news, _ = ex.exchange("a", cursor_a, [])
    assert news == [("r3", H[3:5])]
    _, news, _ = ex.exchange("b", cursor_b, [])
    assert news == []  # nothing new since b's cursor


def test_the_clusters_board_keeps_each_deployments_exchange_apart():
    board = ExchangeBoard()
    board.exchange("app/LLMServer", "a", None, [("r1", H[:2])])
    assert board.exchange("other/LLMServer", "b", None, [])[1] == []
    assert board.exchange("app/LLMServer", "b", None, [])[1] == [("r1", H[:2])]


def test_the_log_is_bounded_by_the_hashes_it_holds_and_a_router_alone_is_told_so():
    ex = IndexExchange(max_hashes=4, alone_after_s=0.05)
    ex.exchange("a", None, [("r1", H[0:2]), ("r1", H[2:4]), ("r2", H[4:6])])
    _, news, _ = ex.exchange("b", None, [])
    assert news == [("r1", H[2:4]), ("r2", H[4:6])]  # the oldest chain went
    time.sleep(0.06)
    _, _, others = ex.exchange("a", 3, [])
    assert others is False  # b has not exchanged within alone_after_s: a need not push


def test_two_routers_exchanging_route_a_turn_where_the_other_sent_the_last_one(serving):
    """Each router exchanges through one in-process IndexExchange (the actor's body; on a cluster,
    the actor: tests/test_router_serve.py) every 10 ms, on its own loop as on Serve."""
    now, shared = time.time(), IndexExchange()

    async def call(router, cursor, entries):
        return shared.exchange(router, cursor, entries)

    a, b = make_router(), make_router()  # sharing off: serving() starts no exchange with a cluster
    serve_a, serve_b = serving(a, [replica(n, now) for n in "wxyz"]), serving(b, [replica(n, now) for n in "wxyz"])
    for router, serve in ((b, serve_b), (a, serve_a)):
        serve.run(_start(router, call))
        serve.run(asyncio.sleep(0.05))  # b exchanges, then a, which hears of b: a pushes from now on
    turn1, answer = SYSTEM + list(range(2000, 2100)), list(range(5000, 5120))
    where = serve_a.route(request(turn1, "t1"), "k1")
    serve_a.complete("k1", where)
    a.record_answer("t1", turn1, answer)
    a.sync.learned("gone", blocks(list(range(9000, 9100))))  # a replica b was never given
    serve_a.run(asyncio.sleep(0.05))  # a pushes
    serve_b.run(asyncio.sleep(0.05))  # b pulls
    turn2 = turn1 + answer + [7, 8, 9]
    answered = (len(turn1) + len(answer) - 1) // 8  # the answer's last token is never computed
    assert b.index.matched_blocks(blocks(turn2)) == {where: answered}
    assert "gone" not in b.index.replicas()
    assert serve_b.choose(request(turn2, "t2"), "k2")[0] == where  # b routes turn 2 where a sent turn 1


async def _start(router, call):
    router.sync.period_s = 0.01
    router.sync.start(router._learned_elsewhere, call)


def test_with_sharing_off_a_router_keeps_nothing_to_share(serving):
    router, now = make_router(share_index_s=0), time.time()
    serve = serving(router, [replica(n, now) for n in "ab"])
    serve.route(request(SYSTEM, "t1"), "k1")
    router.record_answer("t1", SYSTEM, [1, 2, 3])
    assert router.sync._outbox == [] and router.sync._task is None  # no exchange: nothing accumulates
