"""Penalties, logit_bias and min_tokens through HTTP with the official openai client against the tiny
app (real Ray, real Serve): accepted, steering the output exactly as the offline engine does, and
refused with a 400 naming the field when out of range. The ingress's logit_bias limit without Ray."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
from conftest import TINY

from deployments.config import LimitsConfig
from deployments.errors import APIError
from deployments.limits import RequestLimits
from deployments.protocol import GenerateRequest

PROMPT = "The quick brown fox"
HI = [{"role": "user", "content": "hi"}]


# ---- the ingress limit, without Ray --------------------------------------------------------------


def test_logit_bias_size_and_ids_are_limited_at_the_ingress():
    limits = RequestLimits(LimitsConfig(), max_model_len=2048, vocab_size=1000)
    limits.check_request(GenerateRequest(prompt="x", logit_bias={str(t): 1 for t in range(300)}))
    for bias, needle in [
        ({str(t): 1 for t in range(301)}, "301 token ids, more than the limit ingress.limits.max_logit_bias = 300"),
        ({"1000": 1}, "token id 1000 is out of the vocabulary [0, 1000)"),
        ({"-1": 1}, "token id -1"),
    ]:
        with pytest.raises(APIError) as info:
            limits.check_request(GenerateRequest(prompt="x", logit_bias=bias))
        assert info.value.status_code == 400 and info.value.param == "logit_bias"
        assert info.value.message.startswith("logit_bias: ") and needle in info.value.message
    with pytest.raises(APIError, match="max_logit_bias = 0"):
        RequestLimits(LimitsConfig(max_logit_bias=0), 2048, 1000).check_request(
            GenerateRequest(prompt="x", logit_bias={"1": 1})
        )


# ---- through HTTP --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_app):
    return openai.OpenAI(base_url=f"{tiny_app}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The engine's own offline answers for tiny-llama, computed in this process."""
    from batcher import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32"))

    def answer(prompt, **params):
        return engine.generate([prompt], SamplingParams(temperature=0.0, **params))[0]

    answer.engine = engine
    return answer


def test_logit_bias_100_makes_every_token_that_token(tiny, offline):
    the = offline.engine.tokenizer(" the", add_special_tokens=False)["input_ids"][-1]
    expected = offline.engine.tokenizer.decode([the] * 8)
    out = tiny.completions.create(model=TINY, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(the): 100})
    assert out.choices[0].text == expected and out.usage.completion_tokens == 8
    chat = tiny.chat.completions.create(
        model=TINY, messages=HI, max_tokens=8, temperature=1.0, seed=1, logit_bias={the: 100}
    )  # sampled, not greedy: the bias wins still
    assert chat.choices[0].message.content == expected
    plain = tiny.completions.create(model=TINY, prompt=PROMPT, max_tokens=8, temperature=0)
    assert plain.choices[0].text != expected


def test_penalties_steer_a_repetitive_output_as_the_offline_engine_does(tiny, offline):
    first = offline(PROMPT, max_tokens=1).token_ids[0]
    bias = {first: 10.0}  # strong enough that greedy repeats it, weak enough that penalties tell
    repetitive = offline(PROMPT, max_tokens=16, logit_bias=bias)
    assert Counter(repetitive.token_ids).most_common(1)[0][1] >= 8
    cases = [
        ({}, {}),
        ({"frequency_penalty": 2.0}, {}),
        ({"presence_penalty": 2.0}, {}),
        ({"frequency_penalty": -1.0}, {}),
        ({}, {"repetition_penalty": 2.0}),
    ]
    texts = {}
    for openai_fields, extensions in cases:
        expected = offline(PROMPT, max_tokens=16, logit_bias=bias, **openai_fields, **extensions)
        out = tiny.completions.create(
            model=TINY,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            logit_bias={str(first): 10.0},
            extra_body=extensions or None,
            **openai_fields,
        )
        assert out.choices[0].text == expected.text, (openai_fields, extensions)
        texts[str(openai_fields | extensions)] = expected.text
    assert texts[str({"frequency_penalty": 2.0})] != repetitive.text
    assert texts[str({"repetition_penalty": 2.0})] != repetitive.text
    stream = tiny.chat.completions.create(
        model=TINY, messages=HI, max_tokens=16, temperature=0, stream=True, frequency_penalty=2.0, presence_penalty=0.5
    )
    chat_prompt = offline.engine.tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    expected = offline(chat_prompt, max_tokens=16, frequency_penalty=2.0, presence_penalty=0.5)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text


def test_min_tokens_delays_eos(tiny, offline):
    eos = {str(e): 100 for e in offline.engine.eos_token_ids}  # EOS would be every next token
    now = tiny.completions.create(model=TINY, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=eos)
    later = tiny.completions.create(
        model=TINY, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=eos, extra_body={"min_tokens": 4}
    )
    assert now.usage.completion_tokens == 1 and now.choices[0].finish_reason == "stop"
    assert later.usage.completion_tokens == 5 and later.choices[0].finish_reason == "stop"
    assert later.choices[0].text == offline(PROMPT, max_tokens=10, logit_bias=eos, min_tokens=4).text


@pytest.mark.parametrize(
    "chat,fields,extensions,needle",
    [
        (False, {"presence_penalty": 2.5}, {}, "presence_penalty"),
        (True, {"frequency_penalty": -3}, {}, "frequency_penalty"),
        (False, {}, {"repetition_penalty": 0}, "repetition_penalty"),
        (True, {}, {"repetition_penalty": -1.5}, "repetition_penalty"),
        (False, {"logit_bias": {"1": 101}}, {}, "logit_bias"),
        (False, {"logit_bias": {"abc": 1}}, {}, "logit_bias"),
        (False, {"logit_bias": {"49152": 1}}, {}, "logit_bias: token id 49152 is out of the vocabulary [0, 49152)"),
        (True, {"logit_bias": {"-1": 1}}, {}, "logit_bias: token id -1"),
        (False, {"logit_bias": {str(t): 1 for t in range(301)}}, {}, "ingress.limits.max_logit_bias = 300"),
        (False, {}, {"min_tokens": -1}, "min_tokens"),
        (False, {}, {"min_tokens": 9}, "min_tokens: 9 is more than max_tokens 8"),
        (True, {"max_tokens": None, "max_completion_tokens": 4}, {"min_tokens": 5}, "min_tokens"),
        (True, {"max_tokens": None}, {"min_tokens": 5000}, "min_tokens: 5000 is more than max_tokens"),
        (False, {"n": 9}, {}, "n: 9 choices, more than the limit ingress.limits.max_n = 8"),
    ],
)
def test_out_of_range_values_are_400s_naming_the_field(tiny, chat, fields, extensions, needle):
    body = {"model": TINY, "max_tokens": 8, **fields, "extra_body": extensions or None}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            tiny.chat.completions.create(messages=HI, **body)
        else:
            tiny.completions.create(prompt=PROMPT, **body)
    err = info.value
    assert err.status_code == 400
    assert needle in err.message or needle == err.param, (err.message, err.param)
