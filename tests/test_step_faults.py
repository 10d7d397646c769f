"""A step whose forward or sampling raises fails that step's requests, and only those: their streams
get the error, their KV blocks come back, queued requests wait on untouched, the next requests get
exactly a clean engine's tokens. Failing steps in a row kill the loop, and the health check fails.

The faults are real: hooks on tiny-llama's modules make the last decoder layer raise (after the first
layer has written its K/V into the paged cache), or the logits NaN (the sampler's multinomial then
refuses them), in any step whose tokens include MARKER. Over HTTP, the replica's test hook makes its
next forward raise in the model runner.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import torch
from conftest import tiny_config
from ray import serve
from test_serve_faults import Stream, read_stream

from batcher.async_engine import MAX_FAILED_STEPS_IN_A_ROW, AsyncLLMEngine
from batcher.config import EngineConfig
from batcher.engine_input import EngineInput
from batcher.errors import EngineDeadError, StepError
from batcher.llm_engine import LLMEngine
from batcher.sampling_params import SamplingParams
from deployments.llm_server import TEST_HOOKS_ENV

# Exact parity with a clean run: fp32, eager. max_num_seqs 2 leaves a third request queued.
CONFIG = EngineConfig(
    model="tiny-llama",
    dtype="float32",
    compile="off",
    num_threads=1,
    max_model_len=512,
    num_kv_blocks=256,
    block_size=4,
    max_num_seqs=2,
)
MARKER = 4242  # a step whose tokens include this id fails
A, C = [5, 6, 7, 8, 9, 10, 11], [300, 301, 302, 303, 304]
B = [20, 21, MARKER, 22, 23, 24]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class ModelFault:
    """Hooks on the model that fail any forward whose input holds MARKER: the last decoder layer
    raises, or (nan_logits) the logits come out NaN."""

    def __init__(self, model: torch.nn.Module, nan_logits: bool = False):
        self.marked = False
        layers = model.model.layers
        self._hooks = [model.model.embed_tokens.register_forward_pre_hook(self._see_input)]
        if nan_logits:
            self._hooks.append(model.lm_head.register_forward_hook(self._nan))
        else:
            self._hooks.append(layers[-1].register_forward_pre_hook(self._raise))

    def _see_input(self, _module, args):
        self.marked = bool((args[0] == MARKER).any())

    def _raise(self, _module, _args):
        if self.marked:
            raise RuntimeError("injected kernel fault")

    def _nan(self, _module, _args, output):
        return torch.full_like(output, float("nan")) if self.marked else output

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@pytest.fixture(scope="module")
def clean():
    """Each prompt's greedy tokens from an engine that never failed."""
    engine = LLMEngine(CONFIG)
    return {tuple(p): engine.generate(p, GREEDY)[0].token_ids for p in (A, B, C)}


def _run_to_end(engine: LLMEngine) -> dict:
    tokens: dict = {}
    while engine.has_unfinished():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    return tokens


def test_a_failing_forward_fails_its_step_requests_only_and_the_engine_serves_on(clean):
    engine = LLMEngine(CONFIG)
    total = engine.stats().kv_blocks_free
    fault = ModelFault(engine.runner.model)
    a = engine.add_request(EngineInput(A, GREEDY))
    engine.step()
    engine.step()  # `a` is decoding
    b = engine.add_request(EngineInput(B, GREEDY))
    c = engine.add_request(EngineInput(C, GREEDY))  # queued: max_num_seqs is 2
    with pytest.raises(StepError, match="engine step failed: RuntimeError: injected kernel fault") as failed:
        engine.step()
    assert sorted(failed.value.request_ids) == sorted([a, b])
    assert engine.held_request_ids() == [c] and engine.scheduler.waiting[0].num_computed_tokens == 0
    s = engine.stats()
    assert s.kv_blocks_free == total  # a's and b's blocks are back; c holds none yet
    assert (s.failed_steps, s.failed_requests, s.finished_requests) == (1, 2, 0)

    fault.remove()
    b_again = engine.add_request(EngineInput(B, GREEDY))  # what b's failed step half wrote is never reused
    got = _run_to_end(engine)
    assert got[c] == clean[tuple(C)] and got[b_again] == clean[tuple(B)]
    s = engine.stats()
    assert s.kv_blocks_free == total and (s.failed_steps, s.failed_requests, s.finished_requests) == (1, 2, 2)


def test_a_failing_sampler_fails_its_step_and_generate_leaves_nothing_behind(clean):
    engine = LLMEngine(CONFIG)
    total = engine.stats().kv_blocks_free
    ModelFault(engine.runner.model, nan_logits=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=1)
    with pytest.raises(StepError, match="RuntimeError: probability tensor contains"):
        engine.generate([B, A], [sampled, GREEDY])  # one step: b's NaN logits make multinomial raise
    assert not engine.has_unfinished() and engine.stats().kv_blocks_free == total
    assert engine.stats().failed_steps == 1 and engine.stats().failed_requests == 2
    assert engine.generate(A, GREEDY)[0].token_ids == clean[tuple(A)]  # no marker: this step is clean


async def _drain(stream):
    return [d async for d in stream]


def test_a_failing_step_fails_its_streams_and_the_loop_serves_on(clean, caplog):
    e = AsyncLLMEngine(CONFIG)
    ModelFault(e.engine.runner.model)  # hooks set before any step: the loop thread runs them
    total = e.stats().kv_blocks_free

    async def main():
        running = e.stream(EngineInput(A, SamplingParams(max_tokens=400, ignore_eos=True)))
        await running.__anext__()
        with pytest.raises(StepError, match="RuntimeError: injected kernel fault"):
            await asyncio.wait_for(_drain(e.stream(EngineInput(B, GREEDY))), 30)
        with pytest.raises(StepError, match="injected kernel fault"):  # it was in that step too
            await asyncio.wait_for(_drain(running), 30)
        e.check_health()
        return await asyncio.wait_for(e.generate(EngineInput(C, GREEDY)), 30)

    try:
        with caplog.at_level(logging.ERROR, logger="batcher.async_engine"):
            after = asyncio.run(main())
        assert after.token_ids == clean[tuple(C)]
        logged = [r for r in caplog.records if r.name == "batcher.async_engine"]
        assert len(logged) == 1 and "injected kernel fault" in str(logged[0].exc_info[1])
        s = e.stats()
        assert s.loop_alive and s.kv_blocks_free == total
        assert (s.failed_steps, s.failed_requests, s.finished_requests) == (1, 2, 1)
    finally:
        e.shutdown()


def test_failing_steps_in_a_row_kill_the_loop_and_fail_the_health_check():
    e = AsyncLLMEngine(CONFIG)
    ModelFault(e.engine.runner.model)
    short = SamplingParams(max_tokens=2, temperature=0)

    async def fail(n: int):
        for i in range(n):
            with pytest.raises(StepError, match="injected kernel fault"):
                await asyncio.wait_for(e.generate(EngineInput(B + [i], short)), 30)

    async def main():
        await fail(MAX_FAILED_STEPS_IN_A_ROW - 1)
        await asyncio.wait_for(e.generate(EngineInput(A, short)), 30)  # a good step: the count starts again
        await fail(MAX_FAILED_STEPS_IN_A_ROW - 1)
        e.check_health()
        dead = f"{MAX_FAILED_STEPS_IN_A_ROW} engine steps failed in a row, the last with .*injected kernel fault"
        with pytest.raises(EngineDeadError, match=dead):  # this step's request too: the loop died
            await asyncio.wait_for(e.generate(EngineInput(B, short)), 30)
        with pytest.raises(EngineDeadError, match=dead):
            e.check_health()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(e.generate(EngineInput(A, short)), 30)

    try:
        asyncio.run(main())
        assert not e.stats().loop_alive
    finally:
        e.shutdown()


def test_over_http_a_failed_step_is_an_error_event_or_a_500_and_the_replica_serves_on(serve_cluster):
    url = serve_cluster.deploy("step-faults", tiny_config(env_vars={TEST_HOOKS_ENV: "1"}))
    try:
        _failed_steps_over_http(url)
    finally:
        serve_cluster.delete("step-faults")


def _failed_steps_over_http(url: str) -> None:
    handle = serve.get_deployment_handle("LLMServer", "step-faults")
    replica = handle.stats.remote().result()["replica_id"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            s = Stream()
            task = asyncio.create_task(
                read_stream(client, url, {"prompt": "a long story", "max_tokens": 1500, "ignore_eos": True}, s)
            )
            await asyncio.wait_for(s.first.wait(), 60)
            assert s.status == 200 and s.error is None and s.replica == replica
            await handle.fail_engine_steps_for_tests.remote(1)  # the stream's next step raises
            await asyncio.wait_for(task, 60)
            assert s.done and s.finish_reason is None and s.error["type"] == "internal_error", s
            assert "StepError" in s.error["message"] and "fault injected" in s.error["message"], s

            await handle.fail_engine_steps_for_tests.remote(1)
            failed = await client.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4})
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
            assert error["type"] == "internal_error" and "StepError" in error["message"], error

            good = await client.post(
                f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True}
            )
            assert good.status_code == 200 and good.headers["x-iterserve-replica"] == replica, good.text
            assert good.json()["usage"]["completion_tokens"] == 8

    asyncio.run(main())
    stats = handle.stats.remote().result()
    assert stats["replica_id"] == replica and stats["failed_steps"] == 2 and stats["failed_requests"] == 2
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert handle.check_health.remote().result() is None
