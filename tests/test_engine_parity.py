"""Greedy engine output equals HF generate token for token, whatever the scheduling pressure."""

import pytest
import torch

from batcher import EngineConfig, LLMEngine, SamplingParams
from tests.reference import hf_greedy, mixed_prompts

MODELS = ["tiny-llama", "smollm2-135m-instruct"]
MAX_TOKENS = [24, 7, 16, 3, 30, 12, 20]  # mixed lengths: sequences leave the batch at different steps


def run(name, prompts, **engine_kwargs):
    engine = LLMEngine(EngineConfig(model=name, dtype="float32", **engine_kwargs))
    params = [
        SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return engine, engine.generate(prompts, params)


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    name = request.param
    prompts = mixed_prompts(name)
    expected = [hf_greedy(name, p, MAX_TOKENS[i % len(MAX_TOKENS)]) for i, p in enumerate(prompts)]
    return name, prompts, expected


def check(outs, expected, engine):
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total  # every block came back


def test_ample_kv(case):
    name, prompts, expected = case
    engine, outs = run(name, prompts)
    check(outs, expected, engine)
    assert engine.stats().preemptions == 0


def test_tiny_kv_forces_preemption(case):
    name, prompts, expected = case
    engine, outs = run(name, prompts, num_kv_blocks=40, block_size=4, watermark=0.0)
    check(outs, expected, engine)
    assert engine.stats().preemptions > 0


def test_tiny_token_budget_chunks_prefill(case):
    name, prompts, expected = case
    engine, outs = run(name, prompts, max_num_batched_tokens=8)
    check(outs, expected, engine)
    assert max(len(p) for p in prompts) > 8  # so prompts really were split...
    stats = engine.stats()
    assert stats.tokens_computed <= 8 * stats.steps  # ...and no step computed more than the budget


def test_small_steps_on_fewer_threads(case):
    """serve_config.yaml runs small decode steps on 1 thread and the rest on 2: same tokens."""
    name, prompts, expected = case
    before = torch.get_num_threads()
    try:
        engine, outs = run(name, prompts, num_threads=2, small_step_threads=1, small_step_tokens=4)
        check(outs, expected, engine)
        assert torch.get_num_threads() == 1  # the last steps (fewer than 4 sequences left) ran on one
    finally:
        torch.set_num_threads(before)


def test_static_batches(case):
    name, prompts, expected = case
    engine, outs = run(name, prompts, scheduling="static", static_batch_size=3)
    check(outs, expected, engine)


def test_prefix_caching_on_shared_prompt(case):
    name, prompts, _ = case
    system = prompts[2][:40]  # a shared "system prompt" of 40 tokens
    shared = [system + p[-6:] for p in prompts]
    expected = [hf_greedy(name, p, MAX_TOKENS[i % len(MAX_TOKENS)]) for i, p in enumerate(shared)]
    engine, outs = run(name, shared, block_size=8, max_num_seqs=2)
    check(outs, expected, engine)
    stats = engine.stats()
    assert stats.prefix_cache_hits >= (len(shared) - 2) * 40 // 8 * 8
    engine_off, outs_off = run(name, shared, block_size=8, max_num_seqs=2, enable_prefix_caching=False)
    assert [o.token_ids for o in outs_off] == expected
    assert engine_off.stats().prefix_cache_hits == 0
    assert engine_off.stats().tokens_computed > stats.tokens_computed
