"""AsyncLLMEngine: streaming from the loop thread, abort on disconnect, errors, health."""
import asyncio
import time

import pytest

from batcher import (AsyncLLMEngine, EngineConfig, EngineDeadError, InvalidRequestError, LLMEngine,
                     RequestTooLongError, SamplingParams)
from tests.reference import mixed_prompts

CONFIG = EngineConfig(model="tiny-llama", max_model_len=512, num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def engine():
    e = AsyncLLMEngine(CONFIG)
    yield e
    e.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_concurrent_streams_equal_offline_greedy(engine):
    prompts = mixed_prompts("tiny-llama", n_random=5)
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    expected = LLMEngine(CONFIG).generate(prompts, params)

    async def collect(p, sp):
        deltas = [d async for d in engine.stream(p, sp)]
        assert all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].finish_reason == "length"
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

    async def main():
        return await asyncio.gather(*[collect(p, sp) for p, sp in zip(prompts, params)])

    got = run(main())
    assert [g[0] for g in got] == [e.token_ids for e in expected]
    assert [g[1] for g in got] == [e.text for e in expected]


def test_a_slow_reader_gets_the_first_token_alone_and_the_rest_merged(engine):
    async def main():
        stream = engine.stream([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request goes to the engine
        time.sleep(0.5)  # the event loop is stuck while the engine's deltas pile up
        return [await first] + [d async for d in stream]

    deltas = run(main())
    assert len(deltas[0].token_ids) == 1
    assert sum(len(d.token_ids) for d in deltas) == 12 and len(deltas) < 12


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        stream = engine.stream([7, 8, 9], SamplingParams(max_tokens=400, ignore_eos=True), request_id="leaver")
        async for _ in stream:
            break
        assert engine.stats().running == 1
        await stream.aclose()
        for _ in range(100):  # the loop frees it within one step
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)

    run(main())
    stats = engine.stats()
    assert stats.running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.aborted_requests >= 1


def test_cancelled_task_aborts(engine):
    async def consume():
        async for _ in engine.stream([3, 4], SamplingParams(max_tokens=400, ignore_eos=True)):
            pass

    async def main():
        task = asyncio.create_task(consume())
        while engine.stats().running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.01)

    run(main())
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_errors_come_from_the_first_iteration_and_the_loop_lives_on(engine):
    async def first(prompt, params=None, request_id=None):
        async for d in engine.stream(prompt, params, request_id):
            return d

    with pytest.raises(RequestTooLongError, match="max_model_len"):
        run(first(list(range(100, 600)), SamplingParams(max_tokens=100)))
    with pytest.raises(InvalidRequestError):
        run(first(""))

    async def duplicate():
        a = engine.stream([5], SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
        await a.__anext__()
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await first([6], None, "dup")
        await a.aclose()

    run(duplicate())
    done = run(engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)))
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
    """A loop blocked with a request in flight (a hung forward) fails the health check after the
    stall bound; an idle loop, or one that steps again, passes."""
    e = AsyncLLMEngine(CONFIG.model_copy(update={"stall_timeout_s": 0.5}))
    try:
        e.stall_for_tests(1.0)  # idle: no work pending, nothing is stuck
        time.sleep(1.2)
        e.check_health()

        async def stalled_stream():
            stream = e.stream([5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
            await stream.__anext__()  # the request is running in the engine
            e.stall_for_tests(2.0)
            await asyncio.sleep(0.2)
            e.check_health()  # within the bound
            await asyncio.sleep(0.8)
            with pytest.raises(EngineDeadError, match="no step for .* with requests pending"):
                e.check_health()
            await asyncio.sleep(1.5)  # the stall is over: the loop steps again
            e.check_health()
            got = [d async for d in stream]
            assert got[-1].finish_reason == "length"

        run(stalled_stream())
    finally:
        e.shutdown()


def test_default_stall_bound_is_generous_against_step_time(engine):
    assert engine.config.stall_timeout_s is None
    assert engine.stall_timeout_s >= 60.0  # tiny-llama's millisecond steps: the floor


def test_a_model_that_fails_to_load_fails_the_constructor(tmp_path):
    """The model loads in the loop thread; its error still reaches the caller."""
    missing = EngineConfig(model=str(tmp_path / "no-such-model"))
    with pytest.raises(Exception) as sync_error:
        LLMEngine(missing)
    with pytest.raises(type(sync_error.value)):
        AsyncLLMEngine(missing)
