"""The official openai client against the running app (real Ray cluster, real Serve, HTTP)."""

from __future__ import annotations

import openai
import pytest
from conftest import SMOL, SMOL_ENGINE, TINY

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smol_app):
    return openai.OpenAI(base_url=f"{smol_app}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny(tiny_app):
    return openai.OpenAI(base_url=f"{tiny_app}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The engine's own offline answers, computed in this process."""
    from batcher import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(**SMOL_ENGINE))

    def answer(prompt, max_tokens):
        return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]

    def chat_prompt(messages):
        return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    answer.chat_prompt = chat_prompt
    return answer


def test_models_list(smol):
    models = smol.models.list()
    assert [m.id for m in models.data] == [SMOL]
    assert models.data[0].object == "model"


def test_chat_greedy_equals_offline_engine(smol, offline):
    expected = offline(offline.chat_prompt(QUESTION), 24)
    out = smol.chat.completions.create(model=SMOL, messages=QUESTION, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == expected.text
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streaming_equals_offline_engine(smol, offline):
    expected = offline(offline.chat_prompt(QUESTION), 24)
    stream = smol.chat.completions.create(
        model=SMOL, messages=QUESTION, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_completion_greedy_equals_offline_engine(smol, offline):
    prompt = "The three primary colors are"
    expected = offline(prompt, 16)
    out = smol.completions.create(model=SMOL, prompt=prompt, max_tokens=16, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)
    streamed = smol.completions.create(model=SMOL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_completion_logprobs_and_ignore_eos(tiny):
    out = tiny.completions.create(
        model=TINY, prompt="Hello", max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 3 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_chat_logprobs(tiny):
    out = tiny.chat.completions.create(
        model=TINY, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most likely alternative
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def test_seed_makes_sampling_reproducible(tiny):
    def sample(seed):
        return (
            tiny.completions.create(
                model=TINY,
                prompt="Once upon a time",
                max_tokens=12,
                temperature=1.0,
                top_p=0.9,
                seed=seed,
                extra_body={"top_k": 50},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7) != sample(8)  # the seed, not a silently greedy decode, fixes the text


def test_stop_string_ends_the_answer(tiny):
    full = (
        tiny.completions.create(
            model=TINY, prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[3:6]
    assert stop.strip(), f"need a non-blank stop string from {full!r}"
    out = tiny.completions.create(
        model=TINY, prompt="Hello", max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text and full.startswith(out.choices[0].text)


def test_model_may_be_omitted_over_http(tiny_app):
    import httpx

    r = httpx.post(f"{tiny_app}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == TINY
    assert httpx.get(f"{tiny_app}/health", timeout=60).json() == {"status": "ok"}
