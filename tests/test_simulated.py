"""Simulated replicas: the real engine with a step-time model in place of the forward."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from batcher import EngineConfig, EngineInput, LLMEngine, SamplingParams
from batcher.simulated import ANSWER_TEXT, PRESETS, StepTimeModel


@pytest.fixture(scope="module")
def sim() -> LLMEngine:
    return LLMEngine(EngineConfig(model="sim:h100-llama3-8b", num_kv_blocks=512, max_num_seqs=16))


def test_unknown_presets_are_refused_naming_the_known_ones():
    with pytest.raises(ValidationError, match="sim:h100-llama3-8b"):
        EngineConfig(model="sim:a100-nope")


def test_answers_are_deterministic_text_that_ends_with_eos(sim):
    prompt = "What is the capital of France?"
    a, b = sim.generate([prompt, prompt], SamplingParams(max_tokens=1000, temperature=0.8))
    assert a.token_ids == b.token_ids and a.finish_reason == "stop"
    assert a.text.startswith(ANSWER_TEXT) and 64 <= len(a.token_ids) <= 1000
    [c] = sim.generate(prompt, SamplingParams(max_tokens=300, ignore_eos=True))
    assert len(c.token_ids) == 300 and c.finish_reason == "length"


def test_real_scheduler_and_prefix_cache_with_cached_token_counts(sim):
    shared = list(range(1000, 1400))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [first], [second] = sim.generate(shared + [1, 2], params), sim.generate(shared + [3, 4], params)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 400  # 50 blocks of 8 shared
    stats = sim.stats()
    assert stats.simulation == "h100-llama3-8b" and stats.kv_blocks_free == stats.kv_blocks_total == 512


def test_steps_take_the_modelled_time_without_using_a_core(sim):
    """The forward sleeps: wall time follows the model, CPU time stays small."""
    import resource

    step = PRESETS["h100-llama3-8b"].step
    wall, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    before = sim.runner.simulated_seconds
    sim.generate([[7] * 2000], SamplingParams(max_tokens=100, ignore_eos=True))
    wall = time.perf_counter() - wall
    cpu = resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu
    modelled = sim.runner.simulated_seconds - before
    assert modelled >= 100 * step.fixed_s + 2000 * step.prefill_token_s
    assert wall >= 0.95 * modelled and cpu < 0.5 * wall


def test_step_time_model_terms():
    m = StepTimeModel(fixed_s=1.0, prefill_token_s=0.1, decode_seq_s=0.01, context_token_s=0.001)
    assert m.step_seconds(10, 2, 100) == pytest.approx(1.0 + 1.0 + 0.02 + 0.1)


def test_the_engine_counts_the_whole_answers_of_the_requests_that_ended(sim):
    # What a replica's requests generate each (router.cost_model's request size) is read from
    # answers counted whole as they end: finished ones (both choices of n = 2) and aborted ones.
    before = sim.stats()
    sim.generate(list(range(2000, 2040)), SamplingParams(max_tokens=12, n=2, ignore_eos=True, temperature=0.8))
    rid = sim.add_request(EngineInput(list(range(3000, 3040)), SamplingParams(max_tokens=500, ignore_eos=True)))
    for _ in range(6):
        sim.step()
    sim.abort(rid)
    after = sim.stats()
    assert after.ended_output_tokens - before.ended_output_tokens == 2 * 12 + 6
    ended = (after.finished_requests + after.aborted_requests) - (before.finished_requests + before.aborted_requests)
    assert ended == 2
