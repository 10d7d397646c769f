"""AsyncLLMEngine: runs LLMEngine's step loop in its own thread and streams deltas to asyncio callers.

Callers never touch the scheduler: adds and aborts travel through an inbox the loop drains between
steps, and each step's deltas go back to the callers' event loops in one hop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from typing import AsyncIterator, Dict, List, Optional, Tuple

from batcher.config import EngineConfig
from batcher.engine_input import EngineInput
from batcher.engine_request import EngineRequest
from batcher.errors import EngineDeadError, EngineError, InvalidRequestError, StepError
from batcher.eviction_log import EvictedSegment
from batcher.llm_engine import LLMEngine
from batcher.outputs import Completion, EngineSnapshot, EngineStats, StreamDelta, completions_by_choice, merge_by_choice

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
# Default stall bound (EngineConfig.stall_timeout_s unset): generous against the slowest step seen,
# with a floor for the first steps (model warm-up, a long prefill on a loaded CPU).
STALL_FLOOR_S = 60.0
STALL_STEP_FACTOR = 20.0
# A failing step fails only its own requests; this many in a row (a broken device or model, e.g. a
# CUDA error, which poisons every later step) kill the loop, and check_health then has Serve replace
# the replica.
MAX_FAILED_STEPS_IN_A_ROW = 3


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.model
        self._inbox: "queue.SimpleQueue[Tuple[str, object]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: Dict[str, Tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: Optional[BaseException] = None
        self._stopped = False
        self._heartbeat = time.monotonic()  # last time the loop went round
        self._slowest_step_s = 0.0
        self._failed_steps_in_a_row = 0
        self._snapshot: Optional[EngineSnapshot] = None  # replaced (never mutated) by the loop thread
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="iterserve-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:  # the model failed to load: the caller gets that error
            raise self._error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.max_request_tokens = self.engine.max_request_tokens
        self.simulation = self.engine.simulation  # the SimPreset of a simulated replica, else None

    # -- the loop thread ----------------------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        # Every torch op runs in this thread, model loading included: OpenMP keeps a thread team
        # per calling thread, and a second team competes with the first for the same cores.
        try:
            self.engine = LLMEngine(self.config)
            self._snapshot = self.engine.snapshot()
        except BaseException as e:
            self._error = e
            return
        finally:
            ready.set()
        try:
            while not self._stopped:
                deltas = self._drain_inbox()
                if self.engine.has_unfinished():
                    t0 = time.monotonic()
                    try:
                        deltas += self.engine.step()
                        self._failed_steps_in_a_row = 0
                    except StepError as e:
                        self._step_failed(e)
                    self._slowest_step_s = max(self._slowest_step_s, time.monotonic() - t0)
                elif not deltas:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                # The heartbeat before the snapshot: a thread that sees this round's steps must see
                # that the loop went round (check_health read a stall that had ended otherwise).
                self._heartbeat = time.monotonic()
                self._snapshot = self.engine.snapshot()
                self._dispatch(deltas)
        except BaseException as e:  # the replica must learn of it: check_health fails from now on
            logger.exception("iterserve engine loop died; failing every open and new request")
            # Set before the streams are walked: a stream registered after this walk sees it (_run_request).
            self._error = e
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, self._dead_error())

    def _step_failed(self, error: StepError) -> None:
        """Logs the failure once (with the traceback) and fails the step's own streams. The
        MAX_FAILED_STEPS_IN_A_ROW-th failure in a row raises instead: the loop dies (logged there),
        failing every stream, and check_health fails from then on."""
        self._failed_steps_in_a_row += 1
        if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineDeadError(
                f"{self._failed_steps_in_a_row} engine steps failed in a row, the last with {error}"
            ) from error
        logger.error(
            "engine step failed (%d in a row); failing the %d request(s) it had scheduled",
            self._failed_steps_in_a_row,
            len(error.request_ids),
            exc_info=error,
        )
        for rid in error.request_ids:  # one error object per stream: each caller raises its own
            self._dispatch_error(rid, StepError(str(error), (rid,)))

    def _drain_inbox(self) -> List[StreamDelta]:
        deltas = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return deltas
            if kind == "stall":  # stall_for_tests: the loop thread blocks as a hung forward would
                time.sleep(item)
            elif kind == "fail":
                self._fail_next_forwards(item)
            elif kind == "add":
                try:
                    self.engine.add(item)
                except EngineError as e:  # e.g. a duplicate id: that caller's error, not the loop's
                    self._dispatch_error(item.seq.request_id, e)
            else:
                deltas += self.engine.abort_choices(item)

    def _dispatch(self, deltas: List[StreamDelta]) -> None:
        by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[asyncio.Queue, StreamDelta]]] = defaultdict(list)
        for d in deltas:
            target = self._streams.get(d.request_id)
            if target is not None:  # a caller that went away leaves nothing to deliver to
                by_loop[target[0]].append((target[1], d))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _dispatch_error(self, request_id: str, error: BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, error)

    # -- caller side --------------------------------------------------------------------------
    async def stream(self, inp: EngineInput) -> AsyncIterator[StreamDelta]:
        """Yields the request's deltas (with n > 1, its choices' interleaved: StreamDelta.index); tokens
        that piled up while the caller was busy come as one per choice. Leaving the loop early (or
        being cancelled) aborts the request and frees its KV blocks."""
        self.check_health()
        request = await self._make_request(inp)
        async for delta in self._run_request(request):
            yield delta

    async def generate(self, inp: EngineInput) -> Completion:
        """The whole answer of a request with n = 1 (generate_choices takes any n)."""
        if inp.params.n != 1:
            raise InvalidRequestError("generate() returns one completion: use generate_choices() for n > 1")
        return (await self.generate_choices(inp))[0]

    async def generate_choices(self, inp: EngineInput) -> List[Completion]:
        """The n completions of a request, by index."""
        self.check_health()
        request = await self._make_request(inp)
        deltas = [d async for d in self._run_request(request)]
        return completions_by_choice(request.seq.prompt_token_ids, deltas)

    async def _make_request(self, inp: EngineInput) -> EngineRequest:
        # A grammar compile or an adapter read: off the event loop, other requests go on meanwhile.
        if inp.params.structured_outputs is not None or inp.lora_name is not None:
            return await asyncio.to_thread(self.engine.make_request, inp)
        return self.engine.make_request(inp)

    async def load_lora(self, name: str, path: str) -> dict:
        return await asyncio.to_thread(self.engine.load_lora, name, path)

    async def unload_lora(self, name: str) -> bool:
        return self.engine.unload_lora(name)

    def lora_names(self) -> List[str]:
        return self.engine.lora_names()

    async def _run_request(self, request: EngineRequest) -> AsyncIterator[StreamDelta]:
        rid = request.seq.request_id
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        if self._error is not None:  # the loop died after check_health: nobody would ever answer
            self._streams.pop(rid, None)
            raise self._dead_error()
        self._send("add", request)
        finished, first, open_choices = False, True, set(range(request.seq.params.n))
        try:
            while not finished:
                piled = [_raise_if_error(await q.get())]
                # A slow consumer gets piled-up deltas merged (one per choice), but the first token
                # always goes out alone so time-to-first-token stays observable downstream.
                while not first and not q.empty():
                    piled.append(_raise_if_error(q.get_nowait()))
                first = False
                for delta in merge_by_choice(piled):
                    if delta.finish_reason is not None:
                        open_choices.discard(delta.index)
                    finished = not open_choices
                    yield delta
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._send("abort", rid)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def stall_for_tests(self, seconds: float) -> None:
        """Fault injection for tests only: the loop thread sleeps `seconds` before its next step,
        holding whatever work it has, exactly as a hung forward would."""
        self._send("stall", float(seconds))

    def fail_steps_for_tests(self, steps: int = 1) -> None:
        """Fault injection for tests only: the next `steps` forwards raise inside the model runner,
        as a kernel error would (each fails its step's requests; see MAX_FAILED_STEPS_IN_A_ROW)."""
        self._send("fail", int(steps))

    def _fail_next_forwards(self, steps: int) -> None:
        if steps < 1:
            return
        runner = self.engine.runner
        execute, left = runner.execute, [steps]

        def failing(*args, **kwargs):
            left[0] -= 1
            if left[0] <= 0:
                runner.execute = execute
            raise RuntimeError("fault injected by fail_steps_for_tests")

        runner.execute = failing

    def _send(self, kind: str, item: object) -> None:
        self._inbox.put((kind, item))
        self._wake.set()

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of its last round, published by the loop thread: any thread may
        read it (the engine's own queues are the loop's alone)."""
        return self._snapshot

    def report_evictions_every(self, blocks: int) -> None:
        """Log only every `blocks`-th block of a chain, from the root (the ones the request routers'
        prefix indexes keep). Set before serving: blocks already logged stay in the log."""
        self.engine.block_manager.evictions.stride = blocks

    def cut_evictions(self) -> List[EvictedSegment]:
        """The prefix-cache blocks evicted lately, in numbered segments, a new one closed by this call
        (batcher.eviction_log; its own lock makes it safe from any thread): for the routing report."""
        return self.engine.block_manager.evictions.cut()

    def stats(self) -> EngineStats:
        snap = self._snapshot
        return dataclasses.replace(
            snap.stats,
            seconds_since_last_step=time.monotonic() - snap.last_step_time,
            loop_alive=self._thread.is_alive() and self._error is None,
        )

    @property
    def stall_timeout_s(self) -> float:
        """How long the loop may go without a round while it has work (see EngineConfig)."""
        if self.config.stall_timeout_s is not None:
            return self.config.stall_timeout_s
        return max(STALL_FLOOR_S, STALL_STEP_FACTOR * self._slowest_step_s)

    def check_health(self) -> None:
        """Raises EngineDeadError when the loop died, or stopped stepping with work pending."""
        if self._error is not None or not self._thread.is_alive():
            raise self._dead_error()
        idle = time.monotonic() - self._heartbeat
        stats = self._snapshot.stats
        # Open streams count too: a request added just before the loop hung is in no snapshot yet.
        if idle > self.stall_timeout_s and (self._streams or stats.waiting or stats.running):
            raise EngineDeadError(
                f"engine loop made no step for {idle:.1f}s with requests pending "
                f"(stall bound {self.stall_timeout_s:.1f}s)"
            )

    def _dead_error(self) -> EngineDeadError:
        if self._error is not None:
            return EngineDeadError(f"engine loop died: {self._error!r}")
        return EngineDeadError("engine loop is not running (shut down)")

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)


def _deliver(items: List[Tuple[asyncio.Queue, StreamDelta]]) -> None:
    for q, d in items:
        q.put_nowait(d)


def _raise_if_error(item):
    if isinstance(item, BaseException):
        raise item
    return item
