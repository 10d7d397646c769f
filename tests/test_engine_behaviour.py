"""Sampling, stopping, abort and bad input on the offline engine."""

import pytest
from pydantic import ValidationError

from batcher import EngineConfig, EngineInput, InvalidRequestError, LLMEngine, RequestTooLongError, SamplingParams
from tests.reference import mixed_prompts


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(
        EngineConfig(model="tiny-llama", dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4)
    )


@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="float32", num_kv_blocks=256))


def chat(engine, text):
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def test_seeded_sampling_is_independent_of_the_batch(tiny):
    prompts = mixed_prompts("tiny-llama", n_random=5)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = tiny.generate([prompts[0]], params)[0].token_ids
    others = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True) for n, s in ((5, 1), (25, 2), (12, 3))
    ] + [SamplingParams(max_tokens=9, temperature=1.0)] * 3
    together = tiny.generate(prompts[:1] + prompts[1:7], [params] + others[:6])
    assert together[0].token_ids == alone
    assert tiny.generate([prompts[0]], params)[0].token_ids == alone  # and again, after other traffic
    greedy = tiny.generate([prompts[0]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert greedy.token_ids != alone  # sampling really sampled


def test_abort_frees_every_block_running_or_waiting(tiny):
    prompts = mixed_prompts("tiny-llama", n_random=4)
    ids = [tiny.add_request(EngineInput(p, SamplingParams(max_tokens=50, ignore_eos=True))) for p in prompts]
    for _ in range(3):
        tiny.step()
    assert tiny.stats().kv_blocks_free < tiny.stats().kv_blocks_total
    finals = [tiny.abort(i) for i in ids]
    assert all(f.finish_reason == "abort" for f in finals)
    stats = tiny.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert not tiny.has_unfinished() and tiny.abort(ids[0]) is None


def test_too_long_requests_are_refused_and_others_carry_on(tiny):
    good = tiny.add_request(EngineInput([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True)))
    with pytest.raises(RequestTooLongError, match="max_model_len is 256") as e:
        tiny.add_request(EngineInput(list(range(100, 300)), SamplingParams(max_tokens=100)))
    assert e.value.limit == 256 and e.value.needed == 300
    small_kv = LLMEngine(EngineConfig(model="tiny-llama", num_kv_blocks=8, block_size=4, watermark=0))
    with pytest.raises(RequestTooLongError, match="KV cache capacity is 32"):
        small_kv.add_request(EngineInput(list(range(100, 120)), SamplingParams(max_tokens=20)))
    out = []
    while tiny.has_unfinished():
        out += tiny.step()
    assert out[-1].request_id == good and out[-1].num_generated_tokens == 10


def test_invalid_input_is_refused_with_a_clear_message(tiny):
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny.add_request(EngineInput(""))
    with pytest.raises(InvalidRequestError, match="token ids"):
        tiny.add_request(EngineInput([1, 2, 10**9]))
    rid = tiny.add_request(EngineInput([5, 6], SamplingParams(max_tokens=1)))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        tiny.add_request(EngineInput([5, 6], request_id=rid))
    while tiny.has_unfinished():
        tiny.step()


def test_eos_stops_and_text_matches_tokens(smol):
    out = smol.generate(chat(smol, "What is the capital of France?"), SamplingParams(max_tokens=40, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == smol.tokenizer.eos_token_id
    assert out.text == "The capital of France is Paris."
    assert out.text == smol.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_text(smol):
    prompt = chat(smol, "Count from 1 to 10.")
    full = smol.generate(prompt, SamplingParams(max_tokens=40, temperature=0))[0]
    assert "5" in full.text
    out = smol.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=["5"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index("5")]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_length(smol):
    prompt = chat(smol, "Count from 1 to 10.")
    full = smol.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_at = full.token_ids[4]
    out = smol.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]


def test_logprobs(smol):
    out = smol.generate(chat(smol, "Name a colour."), SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3
        best = max(lp.top_logprobs, key=lp.top_logprobs.get)
        assert best == tok and lp.top_logprobs[tok] == pytest.approx(lp.logprob)
    assert smol.generate("Hi", SamplingParams(max_tokens=2))[0].logprobs is None
