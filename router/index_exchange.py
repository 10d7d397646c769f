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
batched with whatever else came meanwhile, and keeps one long poll waiting for the others' entries,
which returns as soon as one is pushed. An answer's entry (its blocks past the prompt) is needed only
by the conversation's next turn, seconds later: it waits up to `ANSWER_DELAY_S` to ride with a send's
push (each push costs an actor call and wakes every other router's poll: two calls more). A router
alone (no other router heard from lately) pushes nothing; its poll returns every `share_index_s`
with nothing.
The exchanges of every deployment live in one small async actor per cluster (`ExchangeBoard`, one
worker process), owned by the process that made it (an ingress replica): it goes with it, and the
next call makes a new one (what routers learn is soft state).
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import ray

from batcher.block_hash import BlockHash
from router.scoring import Routed

log = logging.getLogger(__name__)

# (replica id, a chain of block hashes cached there (root first) joined into one bytes, the request
# sent there as (routed_at, prompt_tokens, uncached_tokens, request_id) or None, the id of a request
# sent there whose prompt's chain these hashes continue (its answer: the request ended) or None).
# Builtins only: Serve pickles the router's package by value (it registers the request router's
# module with cloudpickle), so a Routed, or any class of router/, crossed with its whole class
# definition in every push and pull (5.7 KB for a four-hash entry; the board 9% of a core at 10
# pushes a second, 7% without).
Entry = Tuple[str, bytes, Optional[tuple], Optional[str]]
HASH_BYTES = 32  # a BlockHash: a SHA-256 digest
MAX_KEPT_HASHES = 500_000  # per router: the prompts' chains kept until their answers continue them
ANSWER_DELAY_S = 0.2  # an entry without a send waits this long at most for a send's push


def pack(replica: str, hashes: Sequence[BlockHash], sent: Optional[Routed] = None,
         extends: Optional[str] = None) -> Entry:
    send = None if sent is None else (sent.routed_at, sent.prompt_tokens, sent.uncached_tokens, sent.request_id)
    return replica, b"".join(hashes), send, extends


def unpack(entry: Entry) -> Tuple[str, List[BlockHash], Optional[Routed], Optional[str]]:
    replica, joined, send, extends = entry
    hashes = [joined[i:i + HASH_BYTES] for i in range(0, len(joined), HASH_BYTES)]
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
            self._hashes += len(entry[1]) // HASH_BYTES
        while (self._hashes > self.max_hashes or len(self._log) > self.max_entries) and self._log:
            self._hashes -= len(self._log.popleft()[2][1]) // HASH_BYTES
        c = self.counts
        c["pushes"], c["entries_in"] = c["pushes"] + 1, c["entries_in"] + len(entries)
        c["hashes_in"] += sum(len(e[1]) for e in entries) // HASH_BYTES
        return self._others(router)

    def pull(self, router: str, cursor: Optional[int]) -> Tuple[int, List[Entry], bool]:
        """The other routers' entries after `cursor` (None, a new router: all the log holds), the
        cursor to send next time, and whether another router was heard from lately."""
        self._heard(router)
        cursor = 0 if cursor is None else cursor
        start = self._log[0][0] if self._log else self._seq + 1
        news = [entry for _, src, entry in itertools.islice(self._log, max(0, cursor + 1 - start), None)
                if src != router]
        c = self.counts
        c["entries_out"] += len(news)
        c["hashes_out"] += sum(len(e[1]) for e in news) // HASH_BYTES
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
    """The actor (async: many routers' long polls wait at once): one IndexExchange per deployment,
    for every deployment of the cluster."""

    def __init__(self):
        self._exchanges: Dict[str, IndexExchange] = {}
        self._pushed: Dict[str, asyncio.Event] = {}  # deployment -> set at its next push

    async def push(self, deployment: str, router: str, entries: Sequence[Entry]) -> bool:
        others = self._exchange(deployment).push(router, entries)
        event = self._pushed.pop(deployment, None) if entries else None
        if event is not None:  # wakes the long polls waiting; the next ones wait on a new event
            event.set()
        return others

    async def pull(self, deployment: str, router: str, cursor: Optional[int], wait_s: float):
        """IndexExchange.pull, waiting up to `wait_s` for another router's entries if there are none."""
        exchange, loop = self._exchange(deployment), asyncio.get_running_loop()
        exchange.counts["pulls"] += 1  # one a call, however often it looks while it waits
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

    async def stats(self) -> dict:
        """What went through each deployment's exchange so far (counts since the board started; the
        routers heard from lately), and the CPU seconds this process has used: what sharing costs,
        for benchmarks and operators."""
        return {"cpu_s": time.process_time(),
                "deployments": {d: {**ex.counts, "log_hashes": ex._hashes, "routers": len(ex._seen)}
                                for d, ex in self._exchanges.items()}}

    def _exchange(self, deployment: str) -> IndexExchange:
        return self._exchanges.setdefault(deployment, IndexExchange())


class IndexSync:
    """One router's side: an outbox pushed as soon as the loop is free, and a long poll for the
    others' entries. `board`: what has ExchangeBoard's push and pull (default: the cluster's actor)."""

    def __init__(self, period_s: float, deployment: str):
        self.period_s, self.deployment = period_s, deployment
        self.router_id = uuid.uuid4().hex
        self._outbox: List[Entry] = []
        self._cursor: Optional[int] = None
        self._others = True  # another router was heard from lately (until the first answer: maybe)
        self._board = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None  # the long poll
        self._flushing = False  # a push is scheduled or in flight
        self._delayed = False  # a push of entries without a send is due within ANSWER_DELAY_S
        # Other routers' sends, by request id: an answer's entry carries only the blocks past its
        # prompt (its chain repeats the prompt's, half of what the routers would push otherwise).
        self._prompts: "OrderedDict[str, List[BlockHash]]" = OrderedDict()
        self._prompt_hashes = 0

    def learned(self, replica: str, hashes: Sequence[BlockHash], sent: Optional[Routed] = None,
                extends: Optional[Tuple[str, int]] = None) -> None:
        """`hashes` (a chain) is cached on `replica`, as far as this router knows, and (`sent`) this
        router has just sent it that request, or (`extends`: its id and its prompt's block count) the
        chain is that request's prompt and answer: for the others, pushed as soon as the loop is free
        if a send, else within ANSWER_DELAY_S (kept only while sharing, and not while this router is
        alone). An answer goes even without blocks past its prompt: it tells the others the request
        ended, which no report of theirs would say before FOREIGN_GRACE_S. Safe from any thread."""
        past = extends[1] if extends is not None else 0  # the others have the prompt's blocks from its send
        if self._task is None or not self._others or not (len(hashes) > past or sent or extends):
            return
        self._outbox.append(pack(replica, hashes[past:], sent, extends and extends[0]))
        if self._flushing:
            return
        if sent is not None:
            self._flushing = True
            self._loop.call_soon_threadsafe(self._flush_soon)
        elif not self._delayed:
            self._delayed = True
            self._loop.call_soon_threadsafe(self._loop.call_later, ANSWER_DELAY_S, self._flush_delayed)

    def _flush_delayed(self) -> None:
        self._delayed = False
        if not self._flushing and self._outbox:  # (else a send's push took them, or is about to)
            self._flushing = True
            self._flush_soon()

    def start(self, apply: Callable[[str, List[BlockHash], Optional[Routed], Optional[str]], None],
              board=None) -> None:
        """From the router's loop: shares from now on, through `board` (default: the cluster's
        ExchangeBoard actor), handing each entry another router pushed to `apply` (replica, chain,
        request sent, id of the request that ended there). Once; nothing without a Ray cluster (a
        router built in a test or a benchmark: nothing to share)."""
        if self._task is not None or self.period_s <= 0:
            return
        if board is None:
            if not ray.is_initialized():
                return
            board = _ActorBoard()
        self._board, self._loop = board, asyncio.get_running_loop()
        self._task = self._loop.create_task(self._poll(apply), context=contextvars.Context())

    def _flush_soon(self) -> None:
        # A context of its own, as the poll's: started from a request's, Ray would count its calls as
        # that request's children and cancel them when the request ends (a streamed answer's does).
        self._loop.create_task(self._flush(), context=contextvars.Context())

    async def _flush(self) -> None:
        try:
            while self._outbox:  # what came while a push was in flight goes in the next one
                entries, self._outbox = self._outbox, []
                self._others = await self._board.push(self.deployment, self.router_id, entries)
        except Exception as e:  # the actor's owner went away, or the cluster is stopping: lost (soft state)
            log.debug("index exchange push failed (%s)", e)
            self._outbox.clear()
        finally:
            self._flushing = False

    async def _poll(self, apply: Callable[[str, List[BlockHash], Optional[Routed], Optional[str]], None]) -> None:
        while True:
            try:
                self._cursor, news, self._others = await self._board.pull(
                    self.deployment, self.router_id, self._cursor, self.period_s)
            except Exception as e:  # as in _flush
                log.debug("index exchange pull failed (%s); retrying", e)
                if isinstance(e, ray.exceptions.RayActorError):
                    self._cursor = None  # the next actor starts a new log
                await asyncio.sleep(self.period_s)
                continue
            for replica, hashes, sent, extends in map(unpack, news):
                if extends is not None:  # an answer: its prompt's chain, as sent, then its own blocks
                    prompt = self._prompts.pop(extends, None)
                    if prompt is None:  # sent before this router joined, or forgotten: it ended, no chain
                        hashes = []
                    else:
                        self._prompt_hashes -= len(prompt)
                        hashes = prompt + hashes
                elif sent is not None and sent.request_id:
                    self._keep_prompt(sent.request_id, hashes)
                apply(replica, hashes, sent, extends)

    def _keep_prompt(self, request_id: str, hashes: List[BlockHash]) -> None:
        self._prompt_hashes -= len(self._prompts.pop(request_id, ()))
        self._prompts[request_id] = hashes
        self._prompt_hashes += len(hashes)
        while self._prompt_hashes > MAX_KEPT_HASHES and self._prompts:
            self._prompt_hashes -= len(self._prompts.popitem(last=False)[1])


class _ActorBoard:
    """The cluster's ExchangeBoard actor behind ExchangeBoard's interface; found (or made) on first use."""

    def __init__(self):
        self._actor = None

    async def push(self, deployment: str, router: str, entries: List[Entry]) -> bool:
        return await self._call("push", deployment, router, entries)

    async def pull(self, deployment: str, router: str, cursor: Optional[int], wait_s: float):
        return await self._call("pull", deployment, router, cursor, wait_s)

    async def _call(self, method: str, *args):
        if self._actor is None:  # a GCS lookup (or the actor's creation): off the loop
            self._actor = await asyncio.to_thread(
                _BOARD.options(name="index-exchange", namespace="iterserve", get_if_exists=True).remote)
        try:
            return await getattr(self._actor, method).remote(*args)
        except ray.exceptions.RayActorError:
            # Gone with its owner: found or made again next time. Only then: where this process is
            # the owner, dropping its handle would end the actor for every router.
            self._actor = None
            raise


_BOARD = ray.remote(num_cpus=0)(ExchangeBoard)


def board_stats() -> Optional[dict]:
    """The cluster's ExchangeBoard.stats(), from a process connected to the cluster; None where no
    router has exchanged yet (no board)."""
    try:
        board = ray.get_actor("index-exchange", namespace="iterserve")
    except ValueError:
        return None
    return ray.get(board.stats.remote())
