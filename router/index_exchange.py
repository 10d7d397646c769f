"""What the routers of one deployment learn, shared among them: where prefixes are cached, and the
requests each has just sent.

Every caller of the LLM deployment routes with an LLMRouter of its own: each ingress replica, each
Python handle caller. A router learns where prefixes are cached from its own requests (the chains it
sent, the answers it relayed), and a replica's load from its reports (every routing-stats period)
plus the requests it sent since. With two ingress replicas each saw about half of a conversation's
turns, and none of the other's requests until the next report: both routers, reading the same
report, sent prompts to the same replica that looked light (on Mooncake's trace over 4 busy
simulated replicas, TTFT p90 1.3x what one router reached; in a replay, other routers' requests must
be known within ~10 ms to avoid it, and a report every 0.1 s did not).

So routers share both through an `IndexExchange` per deployment, off the decision's path: a router
pushes each send (a replica, the prompt's chain, the request sent there) as soon as its loop is free,
batched with whatever else came meanwhile, and keeps one subscription open for the others' entries:
a streaming call on which the board sends, as soon as a router pushes, whatever is new. A streamed
batch costs the board about half an actor call (load_tests.exchange_micro), and every push sends one
to every other router: the board's work grows with the square of the routers. An answer's entry (its
blocks past the prompt) is needed only by the conversation's next turn, seconds later: it waits up to
`ANSWER_DELAY_S` to ride with a send's push. A router alone (no other router heard from lately)
pushes nothing; its subscription sends it an empty batch every `share_index_s`.
The exchanges of every deployment live in one small async actor per cluster (`ExchangeBoard`, one
worker process), owned by the process that made it (an ingress replica): it goes with it, and the
next call makes a new one (what routers learn is soft state). Each router's side: router/index_sync.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import ray

from batcher.block_hash import ROUTING_KEY_BYTES
from router.scoring import Routed

# (replica id, a chain of blocks cached there (root first) joined into one bytes, the request sent
# there as (routed_at, prompt_tokens, uncached_tokens, request_id) or None, the id of a request sent
# there whose prompt's chain these blocks continue (its answer: the request ended) or None).
# A block crosses as its routing key (block_hash.routing_key: all the index keeps of a hash), a
# quarter of its 32 bytes, which every other router pulls (load_tests.exchange_micro); and only the
# blocks the routers' indexes keep (router.index_sync), one in four by default.
# Builtins only: Serve pickles the router's package by value (it registers the request router's
# module with cloudpickle), so a Routed, or any class of router/, crossed with its whole class
# definition in every push and pull (5.7 KB for a four-hash entry; the board 9% of a core at 10
# pushes a second, 7% without).
Entry = Tuple[str, bytes, Optional[tuple], Optional[str]]
# A subscription ends after this and its router subscribes again: Ray keeps streaming to one whose
# router is gone, until it ends.
SUBSCRIPTION_S = 10.0


def pack(replica: str, keys: Sequence[bytes], sent: Optional[Routed] = None, extends: Optional[str] = None) -> Entry:
    """An entry of the routing keys `keys` (block_hash.routing_key) of blocks cached on `replica`."""
    send = None if sent is None else (sent.routed_at, sent.prompt_tokens, sent.uncached_tokens, sent.request_id)
    return replica, b"".join(keys), send, extends


def unpack(entry: Entry) -> Tuple[str, List[bytes], Optional[Routed], Optional[str]]:
    """The entry's replica, its chain as routing keys, the request sent and the request it ends."""
    replica, joined, send, extends = entry
    hashes = [joined[i : i + ROUTING_KEY_BYTES] for i in range(0, len(joined), ROUTING_KEY_BYTES)]
    return replica, hashes, None if send is None else Routed(*send), extends


class IndexExchange:
    """The deployment's log of entries (plain Python). Bounded by the hashes and entries it holds: a
    router too far behind gets what is left."""

    def __init__(self, max_hashes: int = 500_000, max_entries: int = 100_000, alone_after_s: float = 10.0):
        self.max_hashes, self.max_entries, self.alone_after_s = max_hashes, max_entries, alone_after_s
        self._log: Deque[Tuple[int, str, Entry]] = deque()  # (sequence number, router, entry)
        self._seq, self._hashes = 0, 0
        self._seen: Dict[str, float] = {}  # router -> when it last pushed or pulled
        self.counts = {"pushes": 0, "pulls": 0, "entries_in": 0, "hashes_in": 0, "entries_out": 0, "hashes_out": 0}

    def push(self, router: str, entries: Sequence[Entry]) -> bool:
        """Appends `router`'s entries; returns whether another router was heard from within
        `alone_after_s` (if not, `router` need not push)."""
        self._heard(router)
        for entry in entries:
            self._seq += 1
            self._log.append((self._seq, router, entry))
            self._hashes += len(entry[1]) // ROUTING_KEY_BYTES
        while (self._hashes > self.max_hashes or len(self._log) > self.max_entries) and self._log:
            self._hashes -= len(self._log.popleft()[2][1]) // ROUTING_KEY_BYTES
        c = self.counts
        c["pushes"], c["entries_in"] = c["pushes"] + 1, c["entries_in"] + len(entries)
        c["hashes_in"] += sum(len(e[1]) for e in entries) // ROUTING_KEY_BYTES
        return self._others(router)

    def pull(self, router: str, cursor: Optional[int]) -> Tuple[int, List[Entry], bool]:
        """The other routers' entries after `cursor` (None, a new router: all the log holds), the
        cursor to send next time, and whether another router was heard from lately."""
        self._heard(router)
        cursor = 0 if cursor is None else cursor
        start = self._log[0][0] if self._log else self._seq + 1
        news = [
            entry for _, src, entry in itertools.islice(self._log, max(0, cursor + 1 - start), None) if src != router
        ]
        c = self.counts
        c["entries_out"] += len(news)
        c["hashes_out"] += sum(len(e[1]) for e in news) // ROUTING_KEY_BYTES
        return self._seq, news, self._others(router)

    def _heard(self, router: str) -> None:
        now = time.monotonic()
        self._seen[router] = now
        for r in [r for r, t in self._seen.items() if t < now - 2 * self.alone_after_s]:
            del self._seen[r]  # gone (its process ended): forgotten

    def _others(self, router: str) -> bool:
        now = time.monotonic()
        return any(t >= now - self.alone_after_s for r, t in self._seen.items() if r != router)


class ExchangeBoard:
    """The actor (async: many routers' subscriptions wait at once): one IndexExchange per deployment,
    for every deployment of the cluster."""

    def __init__(self):
        self._exchanges: Dict[str, IndexExchange] = {}
        self._pushed: Dict[str, asyncio.Event] = {}  # deployment -> set at its next push

    async def push(self, deployment: str, router: str, entries: Sequence[Entry]) -> bool:
        others = self._exchange(deployment).push(router, entries)
        event = self._pushed.pop(deployment, None) if entries else None
        if event is not None:  # wakes the subscriptions waiting; the next ones wait on a new event
            event.set()
        return others

    async def pull(self, deployment: str, router: str, cursor: Optional[int], wait_s: float):
        """IndexExchange.pull, waiting up to `wait_s` for another router's entries if there are none."""
        exchange, loop = self._exchange(deployment), asyncio.get_running_loop()
        exchange.counts["pulls"] += 1  # one a batch returned, however often it looks while it waits
        deadline = loop.time() + wait_s
        while True:
            cursor, news, others = exchange.pull(router, cursor)
            left = deadline - loop.time()
            if news or left <= 0:
                return cursor, news, others
            try:
                await asyncio.wait_for(self._pushed.setdefault(deployment, asyncio.Event()).wait(), left)
            except asyncio.TimeoutError:
                pass

    async def subscribe(
        self, deployment: str, router: str, cursor: Optional[int], wait_s: float, lifetime_s: float = SUBSCRIPTION_S
    ):
        """`pull` after `pull`, each batch sent as it comes. Called streaming, a batch is one message
        to the router where a pull is a call: about half the board's CPU, and no call for the router."""
        loop = asyncio.get_running_loop()
        end = loop.time() + lifetime_s
        while loop.time() < end:
            cursor, news, others = await self.pull(deployment, router, cursor, wait_s)
            yield cursor, news, others

    async def stats(self) -> dict:
        """What went through each deployment's exchange so far (counts since the board started; the
        routers heard from lately), and the CPU seconds this process has used: what sharing costs,
        for benchmarks and operators."""
        return {
            "cpu_s": time.process_time(),
            "deployments": {
                d: {**ex.counts, "log_hashes": ex._hashes, "routers": len(ex._seen)}
                for d, ex in self._exchanges.items()
            },
        }

    def _exchange(self, deployment: str) -> IndexExchange:
        return self._exchanges.setdefault(deployment, IndexExchange())


_BOARD = ray.remote(num_cpus=0)(ExchangeBoard)
BOARD_NAME, BOARD_NAMESPACE = "index-exchange", "iterserve"


def find_or_make_board():
    """The cluster's ExchangeBoard actor's handle: found, or made and owned by this process (which it
    then goes with). Waits on the cluster's control store: call it off an event loop."""
    return _BOARD.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, get_if_exists=True).remote()


def board_stats() -> Optional[dict]:
    """The cluster's ExchangeBoard.stats(), from a process connected to the cluster; None where no
    router has exchanged yet (no board)."""
    try:
        board = ray.get_actor(BOARD_NAME, namespace=BOARD_NAMESPACE)
    except ValueError:
        return None
    return ray.get(board.stats.remote())
