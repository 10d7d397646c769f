"""What the routers of one deployment learn of the replicas' caches, shared among them.

Every caller of the LLM deployment routes with an LLMRouter of its own: each ingress replica, each
Python handle caller. A router learns where prefixes are cached from its own requests (the chains it
sent, the answers it relayed), so with two ingress replicas each sees about half of a conversation's
turns, and a turn whose last one went through the other ingress looks uncached to it. Routers share
what they learn through an `IndexExchange` per deployment, off the decision's path: each router
pushes the chains it learned and pulls the others' every `share_index_s` (one remote call a period,
none per request), and inserts them into its own index. A router alone (no other router exchanged
lately) pushes nothing. The exchanges of every deployment live in one small actor per cluster
(`ExchangeBoard`, one worker process), owned by the process that made it (an ingress replica): it
goes with it, and the next exchange makes a new one (what routers learn is soft state).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from typing import Awaitable, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import ray

from batcher.block_hash import BlockHash

log = logging.getLogger(__name__)

Entry = Tuple[str, List[BlockHash]]  # (replica id, a chain of block hashes cached there, root first)
# IndexExchange.exchange as a coroutine: (router, cursor, entries) -> (cursor, news, others)
Exchange = Callable[[str, Optional[int], List[Entry]], Awaitable[Tuple[int, List[Entry], bool]]]


class IndexExchange:
    """The deployment's log of learned chains (the body of a Ray actor; plain Python). Bounded by the
    hashes it holds: a router too far behind gets what is left."""

    def __init__(self, max_hashes: int = 500_000, alone_after_s: float = 10.0):
        self.max_hashes, self.alone_after_s = max_hashes, alone_after_s
        self._log: Deque[Tuple[int, str, Entry]] = deque()  # (sequence number, router, entry)
        self._seq, self._hashes = 0, 0
        self._seen: Dict[str, float] = {}  # router -> when it last exchanged

    def exchange(self, router: str, cursor: Optional[int], entries: Sequence[Entry]) -> Tuple[int, List[Entry], bool]:
        """Takes `router`'s new entries; returns the cursor to send next time, the other routers'
        entries after `cursor` (None, a new router: all the log holds) and whether another router
        exchanged within `alone_after_s` (if not, `router` need not push)."""
        now = time.monotonic()
        self._seen[router] = now
        cursor = 0 if cursor is None else cursor
        for replica, hashes in entries:
            self._seq += 1
            self._log.append((self._seq, router, (replica, list(hashes))))
            self._hashes += len(hashes)
        while self._hashes > self.max_hashes and self._log:
            self._hashes -= len(self._log.popleft()[2][1])
        start = self._log[0][0] if self._log else self._seq + 1
        news = [entry for _, src, entry in itertools.islice(self._log, max(0, cursor + 1 - start), None)
                if src != router]
        for r in [r for r, t in self._seen.items() if t < now - 2 * self.alone_after_s]:
            del self._seen[r]  # gone (its process ended): forgotten
        others = any(t >= now - self.alone_after_s for r, t in self._seen.items() if r != router)
        return self._seq, news, others


class ExchangeBoard:
    """The actor: one IndexExchange per deployment, for every deployment of the cluster."""

    def __init__(self):
        self._exchanges: Dict[str, IndexExchange] = {}

    def exchange(self, deployment: str, router: str, cursor: Optional[int], entries: Sequence[Entry]):
        return self._exchanges.setdefault(deployment, IndexExchange()).exchange(router, cursor, entries)


class IndexSync:
    """One router's side: an outbox of learned chains and the periodic exchange."""

    def __init__(self, period_s: float, deployment: str):
        self.period_s, self.deployment = period_s, deployment
        self.router_id = uuid.uuid4().hex
        self._outbox: List[Entry] = []
        self._cursor: Optional[int] = None
        self._others = True  # another router exchanged lately (until the first exchange: maybe)
        self._actor = None
        self._task: Optional[asyncio.Task] = None

    def learned(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """`hashes` (a chain) is cached on `replica`, as far as this router knows: for the others (kept
        only while exchanging, and not while this router is alone)."""
        if self._task is not None and self._others and hashes:
            self._outbox.append((replica, list(hashes)))

    def start(self, apply: Callable[[str, List[BlockHash]], None], call: Optional[Exchange] = None) -> None:
        """From the router's loop: exchanges every period from now on, through `call` (default: the
        deployment's IndexExchange on the cluster's ExchangeBoard), handing each chain another router learned to `apply`. Once;
        nothing without a Ray cluster (a router built in a test or a benchmark: nothing to share)."""
        if self._task is not None or self.period_s <= 0:
            return
        if call is None:
            if not ray.is_initialized():
                return
            call = self._call_actor
        self._task = asyncio.get_running_loop().create_task(self._run(apply, call))

    async def _run(self, apply: Callable[[str, List[BlockHash]], None], call: Exchange) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            entries, self._outbox = self._outbox, []
            try:
                self._cursor, news, self._others = await call(self.router_id, self._cursor, entries)
            except Exception as e:  # the actor's owner went away, or the cluster is stopping: next time
                log.debug("index exchange failed (%s); retrying next period", e)
                self._actor, self._cursor = None, None
                continue
            for replica, hashes in news:
                apply(replica, hashes)

    async def _call_actor(self, router: str, cursor: Optional[int], entries: List[Entry]):
        if self._actor is None:  # a GCS lookup (or the actor's creation): off the loop
            self._actor = await asyncio.to_thread(
                _BOARD.options(name="index-exchange", namespace="iterserve", get_if_exists=True).remote)
        return await self._actor.exchange.remote(self.deployment, router, cursor, entries)


_BOARD = ray.remote(num_cpus=0)(ExchangeBoard)
