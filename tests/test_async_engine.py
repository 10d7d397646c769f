"""AsyncLLMEngine: streaming from the loop thread, abort on disconnect, errors, health."""

import asyncio
import collections
import logging
import threading
import time

import pytest

from batcher import (
    AsyncLLMEngine,
    EngineConfig,
    EngineDeadError,
    EngineInput,
    InvalidRequestError,
    LLMEngine,
    RequestTooLongError,
    SamplingParams,
)
from tests.reference import mixed_prompts

CONFIG = EngineConfig(model="tiny-llama", dtype="float32", max_model_len=512, num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def engine():
    e = AsyncLLMEngine(CONFIG)
    yield e
    e.shutdown()


def run(coro):
    return asyncio.run(coro)


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    """Polls until `predicate()` holds; fails (never hangs) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrent_streams_equal_offline_greedy(engine):
    prompts = mixed_prompts("tiny-llama", n_random=5)
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    expected = LLMEngine(CONFIG).generate(prompts, params)

    async def collect(p, sp):
        deltas = [d async for d in engine.stream(EngineInput(p, sp))]
        assert all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].finish_reason == "length"
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

    async def main():
        return await asyncio.gather(*[collect(p, sp) for p, sp in zip(prompts, params)])

    got = run(main())
    assert [g[0] for g in got] == [e.token_ids for e in expected]
    assert [g[1] for g in got] == [e.text for e in expected]


def test_a_slow_reader_gets_the_first_token_alone_and_the_rest_merged(engine):
    async def main():
        stream = engine.stream(EngineInput([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request goes to the engine
        # This event loop is stuck (a busy caller) until the engine has generated everything.
        deadline = time.monotonic() + 30
        while engine.stats().generated_tokens < before + 12:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return [await first] + [d async for d in stream]

    before = engine.stats().generated_tokens

    deltas = run(main())
    assert len(deltas[0].token_ids) == 1
    assert sum(len(d.token_ids) for d in deltas) == 12 and len(deltas) < 12


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        stream = engine.stream(
            EngineInput([7, 8, 9], SamplingParams(max_tokens=400, ignore_eos=True), request_id="leaver")
        )
        async for _ in stream:
            break
        assert engine.stats().running == 1
        await stream.aclose()
        await wait_for(lambda: engine.stats().running == 0)  # the loop frees it at its next round

    run(main())
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.aborted_requests >= 1


def test_cancelled_task_aborts(engine):
    async def consume():
        async for _ in engine.stream(EngineInput([3, 4], SamplingParams(max_tokens=400, ignore_eos=True))):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await wait_for(lambda: engine.stats().running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: engine.stats().running == 0)

    run(main())
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_errors_come_from_the_first_iteration_and_the_loop_lives_on(engine):
    async def first(prompt, params=None, request_id=None):
        async for d in engine.stream(EngineInput(prompt, params or SamplingParams(), request_id)):
            return d

    with pytest.raises(RequestTooLongError, match="max_model_len"):
        run(first(list(range(100, 600)), SamplingParams(max_tokens=100)))
    with pytest.raises(InvalidRequestError):
        run(first(""))

    async def duplicate():
        a = engine.stream(EngineInput([5], SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup"))
        await a.__anext__()
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await first([6], None, "dup")
        await a.aclose()

    run(duplicate())
    done = run(engine.generate(EngineInput([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))))
    assert len(done.token_ids) == 4 and done.finish_reason == "length"
    engine.check_health()
    assert engine.stats().loop_alive


def test_check_health_fails_when_the_loop_is_gone():
    e = AsyncLLMEngine(CONFIG)
    e.check_health()
    e.shutdown()
    with pytest.raises(EngineDeadError, match="not running"):
        e.check_health()


def test_check_health_fails_while_the_loop_is_stuck_with_work():
    """A loop blocked with a request in flight (a hung forward) fails the health check once past the
    stall bound, and passes again when it steps again; an idle loop that blocks is not stuck."""
    e = AsyncLLMEngine(CONFIG.model_copy(update={"stall_timeout_s": 0.5}))

    def health_error():
        try:
            e.check_health()
        except EngineDeadError as err:
            return err
        return None

    try:
        e.stall_for_tests(1.0)  # idle: no work pending, nothing is stuck
        time.sleep(1.2)
        e.check_health()

        async def stalled_stream():
            stream = e.stream(EngineInput([5, 6], SamplingParams(max_tokens=400, ignore_eos=True)))
            await stream.__anext__()  # the request is running in the engine
            steps = e.stats().steps
            e.stall_for_tests(4.0)
            await wait_for(lambda: health_error() is not None, timeout_s=3.5)  # within the stall
            assert "with requests pending" in str(health_error())
            assert e.stats().steps <= steps + 1  # it failed while the loop was indeed stuck
            await wait_for(lambda: e.stats().steps > steps + 1)  # the stall is over: it steps again
            e.check_health()
            got = [d async for d in stream]
            assert got[-1].finish_reason == "length"

        run(stalled_stream())
    finally:
        e.shutdown()


def test_a_round_is_published_no_sooner_than_its_heartbeat():
    """The snapshot (steps, queues) another thread reads and the heartbeat check_health reads are
    published in that order: a round's steps visible with the heartbeat still from before a stall
    made a health check right after the stall fail a loop that was stepping again (a flaky CI run)."""
    e = AsyncLLMEngine(CONFIG.model_copy(update={"stall_timeout_s": 0.5}))
    lags = []
    publish = e.engine.snapshot

    def snapshot():  # runs in the loop thread, as the loop publishes a round
        lags.append(time.monotonic() - e._heartbeat)
        return publish()

    e.engine.snapshot = snapshot
    try:

        async def stalled_stream():
            stream = e.stream(EngineInput([5, 6], SamplingParams(max_tokens=40, ignore_eos=True)))
            await stream.__anext__()
            e.stall_for_tests(1.0)
            return [d async for d in stream]

        assert run(stalled_stream())[-1].finish_reason == "length"
        assert max(lags) < 0.5, max(lags)  # the stalled round's too: 1 s before the fix
    finally:
        e.shutdown()


def test_a_model_that_fails_to_load_fails_the_constructor(tmp_path):
    """The model loads in the loop thread; its error still reaches the caller."""
    missing = EngineConfig(model=str(tmp_path / "no-such-model"))
    with pytest.raises(Exception) as sync_error:
        LLMEngine(missing)
    with pytest.raises(type(sync_error.value)):
        AsyncLLMEngine(missing)


def _watched(base: type) -> type:
    """A scheduler queue type that records which threads read it."""

    class Watched(base):
        readers: set

        def __iter__(self):
            self.readers.add(threading.current_thread().name)
            return base.__iter__(self)

        def __len__(self):
            self.readers.add(threading.current_thread().name)
            return base.__len__(self)

    return Watched


def test_callers_read_a_published_snapshot_never_the_engine_queues():
    """stats() and snapshot() from the caller's thread while the loop admits and steps: only the
    engine thread walks the scheduler's queues (a caller walking them meets 'deque mutated during
    iteration' under contention)."""
    e = AsyncLLMEngine(CONFIG)
    try:
        readers: set = set()
        sched = e.engine.scheduler
        waiting, running = _watched(collections.deque)(sched.waiting), _watched(list)(sched.running)
        waiting.readers = running.readers = readers
        sched.waiting, sched.running = waiting, running

        async def one(i):
            return [
                d async for d in e.stream(EngineInput([5 + i, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True)))
            ]

        async def main():
            tasks = [asyncio.ensure_future(one(i)) for i in range(12)]
            seen = []
            while not all(t.done() for t in tasks):
                seen.append((e.stats().running, e.snapshot().held_request_ids))
                await asyncio.sleep(0.001)  # a reader spinning on sleep(0) starved the engine thread of the GIL
            await asyncio.gather(*tasks)
            return seen

        seen = run(main())
        assert any(running > 0 and held for running, held in seen)  # the snapshot did follow the load
        assert readers == {"iterserve-engine"}
        final = e.stats()
        assert final.running == final.waiting == 0 and final.finished_requests == 12
    finally:
        e.shutdown()


def _break_the_loop(e: AsyncLLMEngine) -> None:
    """The loop thread's next step raises outside the forward and the sampler (a failing forward
    fails only its step's requests: tests/test_step_faults.py), so the loop dies."""

    def schedule():
        raise RuntimeError("scheduler failed")

    e.engine.scheduler.schedule = schedule


async def _drain(stream):
    return [d async for d in stream]


def test_a_dead_loop_is_logged_once_and_fails_open_streams_at_once(caplog):
    e = AsyncLLMEngine(CONFIG)
    try:

        async def main():
            stream = e.stream(EngineInput([5, 6], SamplingParams(max_tokens=400, ignore_eos=True)))
            await stream.__anext__()
            _break_the_loop(e)
            with pytest.raises(EngineDeadError, match="scheduler failed"):
                await asyncio.wait_for(_drain(stream), 10)
            with pytest.raises(EngineDeadError, match="scheduler failed"):
                await asyncio.wait_for(_drain(e.stream(EngineInput([7], SamplingParams(max_tokens=4)))), 10)

        with caplog.at_level(logging.ERROR, logger="batcher.async_engine"):
            run(main())
        died = [r for r in caplog.records if r.name == "batcher.async_engine"]
        assert len(died) == 1 and died[0].exc_info and "scheduler failed" in str(died[0].exc_info[1])
    finally:
        e.shutdown()


def test_a_stream_registered_just_after_the_loop_died_fails_at_once():
    """The loop dies between the caller's health check and its stream's registration: the stream
    must fail at once, not wait for the health check to replace the replica."""
    e = AsyncLLMEngine(CONFIG)
    try:
        make_request = e.engine.make_request

        def make_then_die(*args, **kwargs):
            request = make_request(*args, **kwargs)
            _break_the_loop(e)
            e.abort("nothing")  # wakes the loop: it steps nothing yet
            e._send("add", make_request(EngineInput([9, 9], SamplingParams(max_tokens=2))))
            e._thread.join(timeout=10)
            assert not e._thread.is_alive()
            return request

        e.engine.make_request = make_then_die

        async def main():
            return await asyncio.wait_for(_drain(e.stream(EngineInput([5], SamplingParams(max_tokens=4)))), 10)

        with pytest.raises(EngineDeadError, match="scheduler failed"):
            run(main())
    finally:
        e.shutdown()
