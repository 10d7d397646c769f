"""Each router's side of the routers' exchange (router/index_exchange.py): `IndexSync` pushes what
this router learns and sends, and applies what the others push, through the cluster's
`ExchangeBoard` actor (`_ActorBoard`)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

import ray

from batcher.block_hash import BlockHash, routing_key
from router.index_exchange import Entry, find_or_make_board, pack, unpack
from router.scoring import Routed

log = logging.getLogger(__name__)

# What a router does with each entry another router pushed: (replica, its chain as the routing keys of
# the blocks an index keeps (PrefixIndex.insert_keys), the request sent there or None, the id of a
# request that ended there or None).
Apply = Callable[[str, List[bytes], Optional[Routed], Optional[str]], None]
# The routing keys of the kept blocks of a chain, from a block on (PrefixIndex.kept_keys).
KeptKeys = Callable[[Sequence[BlockHash], int], List[bytes]]
MAX_KEPT_HASHES = 500_000  # per router: the prompts' chains kept until their answers continue them
ANSWER_DELAY_S = 0.2  # an entry without a send waits this long at most for a send's push


class IndexSync:
    """One router's side: an outbox pushed as soon as the loop is free, and a subscription to the
    others' entries. `board`: what has ExchangeBoard's push and subscribe (default: the cluster's actor).
    An entry carries the routing keys of the blocks the routers' indexes keep of its chain (`kept`:
    PrefixIndex.kept_keys, one block in four by default; every block's if None): a quarter of every
    block's, so the board's log, each router's kept prompts and the bytes each router takes in cover
    four times the requests."""

    def __init__(self, period_s: float, deployment: str, kept: Optional[KeptKeys] = None):
        self.period_s, self.deployment = period_s, deployment
        self._kept = kept or _every_block
        self.router_id = uuid.uuid4().hex
        self._outbox: List[Entry] = []
        self._cursor: Optional[int] = None
        self._others = True  # another router was heard from lately (until the first answer: maybe)
        self._board = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None  # the subscription
        self._flushing = False  # a push is scheduled or in flight
        self._delayed = False  # a push of entries without a send is due within ANSWER_DELAY_S
        # Other routers' sends, by request id: an answer's entry carries only the blocks past its
        # prompt (its chain repeats the prompt's, half of what the routers would push otherwise).
        self._prompts: "OrderedDict[str, List[bytes]]" = OrderedDict()  # their routing keys
        self._prompt_hashes = 0

    def learned(
        self,
        replica: str,
        hashes: Sequence[BlockHash],
        sent: Optional[Routed] = None,
        extends: Optional[Tuple[str, int]] = None,
    ) -> None:
        """`hashes` (a chain) is cached on `replica`, as far as this router knows, and (`sent`) this
        router has just sent it that request, or (`extends`: its id and its prompt's block count) the
        chain is that request's prompt and answer: for the others, pushed as soon as the loop is free
        if a send, else within ANSWER_DELAY_S (kept only while sharing, and not while this router is
        alone). An answer goes even without blocks past its prompt: it tells the others the request
        ended, which no report of theirs would say before FOREIGN_GRACE_S. Safe from any thread."""
        past = extends[1] if extends is not None else 0  # the others have the prompt's blocks from its send
        if self._task is None or not self._others or not (len(hashes) > past or sent or extends):
            return
        self._outbox.append(pack(replica, self._kept(hashes, past), sent, extends and extends[0]))
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

    def start(self, apply: Apply, board=None) -> None:
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
        self._task = self._loop.create_task(self._subscription(apply), context=contextvars.Context())

    def _flush_soon(self) -> None:
        # A context of its own, as the subscription's: started from a request's, Ray would count its
        # calls as that request's children and cancel them when the request ends (a streamed answer's does).
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

    async def _subscription(self, apply: Apply) -> None:
        while True:  # subscribed again when a subscription ends (SUBSCRIPTION_S) or fails
            try:
                async for self._cursor, news, self._others in self._board.subscribe(  # noqa: B020
                    self.deployment, self.router_id, self._cursor, self.period_s
                ):
                    self._take(news, apply)
            except Exception as e:  # as in _flush
                log.debug("index exchange subscription failed (%s); retrying", e)
                if isinstance(e, ray.exceptions.RayActorError):
                    self._cursor = None  # the next actor starts a new log
                await asyncio.sleep(self.period_s)

    def _take(self, news: List[Entry], apply: Apply) -> None:
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

    def _keep_prompt(self, request_id: str, hashes: List[bytes]) -> None:
        self._prompt_hashes -= len(self._prompts.pop(request_id, ()))
        self._prompts[request_id] = hashes
        self._prompt_hashes += len(hashes)
        while self._prompt_hashes > MAX_KEPT_HASHES and self._prompts:
            self._prompt_hashes -= len(self._prompts.popitem(last=False)[1])


def _every_block(hashes: Sequence[BlockHash], start: int = 0) -> List[bytes]:
    return [routing_key(h) for h in hashes[start:]]


class _ActorBoard:
    """The cluster's ExchangeBoard actor behind ExchangeBoard's interface; found (or made) on first use."""

    def __init__(self):
        self._actor = None

    async def push(self, deployment: str, router: str, entries: List[Entry]) -> bool:
        actor = await self._handle()
        try:
            return await actor.push.remote(deployment, router, entries)
        except ray.exceptions.RayActorError:
            self._lost(actor)
            raise

    async def subscribe(self, deployment: str, router: str, cursor: Optional[int], wait_s: float):
        actor = await self._handle()
        try:
            async for batch in actor.subscribe.options(num_returns="streaming").remote(
                deployment, router, cursor, wait_s
            ):
                yield await batch
        except ray.exceptions.RayActorError:
            self._lost(actor)
            raise

    async def _handle(self):
        if self._actor is None:  # a GCS lookup (or the actor's creation): off the loop
            self._actor = await asyncio.to_thread(find_or_make_board)
        return self._actor

    def _lost(self, actor) -> None:
        # Gone with its owner: found or made again next time. Only then: where this process is the
        # owner, dropping its handle would end the actor for every router.
        if self._actor is actor:
            self._actor = None
