"""`n` > 1: one prompt prefilled once, then forked into n choices that share its blocks.

Engine level (tiny-llama, in process): prefill tokens counted, blocks shared then all freed, greedy
choices equal to HF generate (so the forked partial block's K/V is right), seeded choices distinct
and the same whatever the batch, choices without a seat or a block, preemption and abort. Then HTTP
through the official openai client and the Python handle against the session's tiny app (real Ray,
real Serve), and the ingress limit `max_n` without Ray.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import TINY, eventually

from batcher import AsyncLLMEngine, EngineConfig, EngineInput, LLMEngine, SamplingParams
from deployments.config import LimitsConfig
from deployments.errors import APIError
from deployments.limits import RequestLimits
from deployments.protocol import GenerateRequest
from tests.reference import hf_greedy, mixed_prompts

BS = 4
GREEDY3 = SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True)
SEEDED3 = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)


def tiny_engine(**config) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=TINY, dtype="float32", max_model_len=256, block_size=BS, **{"num_kv_blocks": 128, **config})
    )


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine()


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(TINY, n_random=3)


def step_until_forked(engine: LLMEngine, request_id: str, n: int) -> None:
    while len(engine.requests[request_id].choices) < n:
        engine.step()


# ---- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [37, 36])  # a partial last block (copied), and none
def test_prompt_is_prefilled_once_and_its_blocks_shared_then_freed(tiny, prompts, prompt_len):
    prompt = (prompts[0] * 2)[:prompt_len]
    bm, start = tiny.block_manager, tiny.block_manager.num_free_blocks
    computed = tiny.counters.tokens_computed
    request = tiny.make_request(EngineInput(prompt, GREEDY3, cache_salt=f"len{prompt_len}"))  # nothing cached before
    tiny.add(request)
    rid = request.seq.request_id
    step_until_forked(tiny, rid, 3)
    assert tiny.counters.tokens_computed - computed == prompt_len  # the prompt once, not three times
    seqs = [c.seq for c in tiny.requests[rid].choices]
    full = prompt_len // BS
    assert [s.block_table[:full] for s in seqs[1:]] == [seqs[0].block_table[:full]] * 2
    assert all(bm.blocks[b].ref_count == 3 for b in seqs[0].block_table[:full])
    tails = {s.block_table[full] for s in seqs if len(s.block_table) > full}
    assert len(tails) == (3 if prompt_len % BS else 0)  # each choice writes its own partial block
    while tiny.has_unfinished():
        tiny.step()
    assert tiny.counters.tokens_computed - computed == prompt_len + 3 * (GREEDY3.max_tokens - 1)
    assert bm.num_free_blocks == start and all(b.ref_count == 0 for b in bm.blocks)


def test_greedy_choices_are_identical_and_equal_hf_generate(tiny, prompts):
    outs = tiny.generate(prompts[:2], GREEDY3)
    assert [(o.index, o.finish_reason) for o in outs] == [(i, "length") for i in range(3)] * 2
    for k, prompt in enumerate(prompts[:2]):
        expected = hf_greedy(TINY, prompt, GREEDY3.max_tokens)
        assert [o.token_ids for o in outs[3 * k : 3 * k + 3]] == [expected] * 3


def test_seeded_choices_are_distinct_and_the_same_in_any_batch(tiny, prompts):
    alone = [o.token_ids for o in tiny.generate(prompts[0], SEEDED3)]
    assert len({tuple(t) for t in alone}) == 3  # each choice samples its own stream
    others = [
        SamplingParams(n=2, max_tokens=7, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True),
    ]
    together = tiny.generate([prompts[1], prompts[0], prompts[2]], [others[0], SEEDED3, others[1]])
    assert [o.token_ids for o in together[2:5]] == alone
    single = tiny.generate(prompts[0], SEEDED3.model_copy(update={"n": 1}))
    assert single[0].token_ids == alone[0]  # choice 0 samples with the request's own seed


def test_each_choice_stops_on_its_own(tiny, prompts):
    free = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=21, ignore_eos=True)
    first = [o.token_ids for o in tiny.generate(prompts[1], free)]
    stop_at = first[1][2]  # choice 1 stops at its third token; the others where (and if) they meet it
    outs = tiny.generate(prompts[1], free.model_copy(update={"stop_token_ids": [stop_at]}))
    for o, tokens in zip(outs, first):
        k = tokens.index(stop_at) + 1 if stop_at in tokens else len(tokens)
        assert (o.token_ids, o.finish_reason) == (tokens[:k], "stop" if stop_at in tokens else "length")
    assert "length" in {o.finish_reason for o in outs}  # the others ran on: the stop was choice 1's alone
    assert [o.finish_reason for o in tiny.generate(prompts[1], GREEDY3.model_copy(update={"max_tokens": 1}))] == [
        "length"
    ] * 3  # every choice ends in the step that forks it
    assert tiny.block_manager.num_free_blocks == tiny.block_manager.num_blocks


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_seqs": 2},
        {"max_num_seqs": 3, "enable_prefix_caching": False},
        {"num_kv_blocks": 16},
        {"scheduling": "static", "static_batch_size": 2},
    ],
)
def test_choices_without_a_seat_or_block_wait_and_come_back_the_same(prompts, config):
    """Too few seats: the choices that find none wait, and come back through the prefix cache (or
    recompute the prompt without one). Too few blocks: choices are preempted and recomputed. A
    static batch of 2: the choices past it wait for the batch's next round."""
    engine = tiny_engine(**config)
    outs = engine.generate(prompts[0], SamplingParams(n=4, max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(TINY, prompts[0], 12)] * 4
    if "num_kv_blocks" in config:
        assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("steps", [0, 1, 3])  # before the prompt is computed (nothing forked yet), and after
def test_abort_ends_every_choice_and_frees_every_block(tiny, prompts, steps):
    start = tiny.block_manager.num_free_blocks
    rid = tiny.add_request(EngineInput(prompts[0], SamplingParams(n=3, max_tokens=50, ignore_eos=True)))
    for _ in range(steps):
        tiny.step()
    finals = tiny.abort_choices(rid)
    assert sorted(d.index for d in finals) == [0, 1, 2] and {d.finish_reason for d in finals} == {"abort"}
    assert tiny.block_manager.num_free_blocks == start and not tiny.has_unfinished()
    assert tiny.abort_choices(rid) == []


def test_async_stream_interleaves_choices_and_ends_after_the_last():
    async def main():
        engine = AsyncLLMEngine(
            EngineConfig(model=TINY, dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=BS)
        )
        try:
            prompt = [5, 6, 7, 8, 9]
            deltas = [
                d
                async for d in engine.stream(
                    EngineInput(prompt, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=2, ignore_eos=True))
                )
            ]
            whole = await engine.generate_choices(
                EngineInput(prompt, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=2, ignore_eos=True))
            )
            # The loop publishes its snapshot after the round that freed the blocks, in its own thread.
            stats = await eventually(
                lambda: (st := engine.stats()).kv_blocks_free == st.kv_blocks_total and st, 30, "every block free"
            )
            return deltas, whole, stats
        finally:
            engine.shutdown()

    deltas, whole, stats = asyncio.run(main())
    by_index = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in range(3)}
    assert [by_index[c.index] for c in whole] == [c.token_ids for c in whole]  # seeded: the same again
    assert deltas[-1].finish_reason == "length"  # the stream ends with the last choice's finish
    assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1, 2]
    assert stats.kv_blocks_free == stats.kv_blocks_total


# ---- the ingress limit, without Ray --------------------------------------------------------------


def test_n_is_limited_at_the_ingress():
    limits = RequestLimits(LimitsConfig(), max_model_len=2048, vocab_size=1000)
    limits.check_request(GenerateRequest(prompt="x", n=8))
    with pytest.raises(APIError) as info:
        limits.check_request(GenerateRequest(prompt="x", n=9))
    assert info.value.status_code == 400 and info.value.param == "n"
    assert "9 choices, more than the limit ingress.limits.max_n = 8" in info.value.message


# ---- through HTTP and the handle (the session's tiny app) ----------------------------------------


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=f"{tiny_app}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_with_n_non_streamed(client):
    greedy = dict(model=TINY, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    one, out = client.completions.create(**greedy), client.completions.create(n=3, **greedy)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [one.choices[0].text] * 3  # greedy choices are the same
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert out.usage.completion_tokens == 3 * one.usage.completion_tokens == 24
    seeded = dict(model=TINY, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=5, n=3)
    a, b = client.completions.create(**seeded), client.completions.create(**seeded)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3


def test_chat_with_n_streamed_equals_non_streamed(client):
    request = dict(
        model=TINY,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=10,
        temperature=1.0,
        seed=9,
        n=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**request)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 3
    texts, finishes, roles, usage = {}, {}, [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            roles += [c.index] if c.delta.role else []
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, []) + [c.finish_reason]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finishes == {i: ["length"] for i in range(3)} and sorted(roles) == [0, 1, 2]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 30)


def test_completions_stream_with_n_ends_once(tiny_app):
    body = {
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{tiny_app}/v1/completions", json=body, timeout=120) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert sorted(finished) == [0, 1]
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [10]
    assert not chunks[-1]["choices"]  # the usage comes last, after every choice's finish


@pytest.mark.parametrize("n", [0, 9])
def test_n_out_of_range_is_a_400_naming_n(client, n):
    for create in (
        lambda: client.completions.create(model=TINY, prompt="hi", max_tokens=2, n=n),
        lambda: client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=n
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        assert info.value.status_code == 400 and info.value.body["param"] == "n"


def test_handle_generate_and_stream_with_n(tiny_app):
    from ray import serve

    handle = serve.get_app_handle("tiny")
    request = GenerateRequest(prompt="Hello there", max_tokens=6, temperature=1.0, seed=4, n=2, ignore_eos=True)
    out = handle.generate.remote(request).result()
    assert [c.index for c in out.choices] == [0, 1] and out.text == out.choices[0].text
    assert out.completion_tokens == 12 and [c.finish_reason for c in out.choices] == ["length"] * 2
    chunks = list(handle.options(stream=True).stream.remote(request))
    assert [[t for ch in chunks if ch.index == i for t in ch.token_ids] for i in (0, 1)] == [
        c.token_ids for c in out.choices
    ]
