"""GenerateRequest is the public request type (handles and HTTP bodies): its fields, defaults and
errors are API, held apart from the engine's SamplingParams, into which `sampling_params` converts it."""

from __future__ import annotations

import pytest
from conftest import SMOL

from batcher.engine_input import EngineInput
from batcher.sampling_params import SamplingParams
from batcher.structured_outputs import StructuredOutputs
from deployments.errors import APIError
from deployments.protocol import GenerateRequest, PreparedRequest

# The public fields, in order (pydantic reports field errors in this order and a 400 names the first),
# with their defaults.
FIELDS = {
    "max_tokens": None,
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "logprobs": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "min_tokens": 0,
    "structured_outputs": None,
    "prompt": None,
    "messages": None,
    "request_id": None,
    "cache_salt": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": True,
    "model": None,
}


def test_the_public_fields_and_their_defaults_are_the_same():
    assert not issubclass(GenerateRequest, SamplingParams)
    got = {name: f.get_default(call_default_factory=True) for name, f in GenerateRequest.model_fields.items()}
    assert list(got) == list(FIELDS) and got == FIELDS
    assert GenerateRequest.model_config["extra"] == "forbid"


@pytest.fixture(scope="module")
def prepare_body():
    from batcher.model_files import load_tokenizer
    from deployments.config import LimitsConfig
    from deployments.limits import RequestLimits
    from deployments.prompts import prepare

    tok = load_tokenizer(SMOL)
    limits = RequestLimits(LimitsConfig(), 512, len(tok))
    return lambda body: prepare(tok, body, limits)


@pytest.mark.parametrize(
    "extra,param,message",
    [
        ({"bogus": 1}, "bogus", "bogus: Extra inputs are not permitted"),
        ({"temperature": 101}, "temperature", "temperature: Input should be less than or equal to 100"),
        ({"top_p": 0}, "top_p", "top_p: Input should be greater than 0"),
        ({"n": 129}, "n", "n: Input should be less than or equal to 128"),
        ({"seed": 2**64}, "seed", "seed: must be a 64-bit integer in [-9223372036854775808, 18446744073709551615]"),
        ({"stop": ["a", ""]}, "stop", "stop: stop strings must not be empty"),
        (
            {"frequency_penalty": float("inf")},
            "frequency_penalty",
            "frequency_penalty: Input should be a finite number",
        ),
        (
            {"logit_bias": {"1": 101}},
            "logit_bias",
            "logit_bias: the bias of token 1 is 101.0, not a number in [-100, 100]",
        ),
        ({"min_tokens": 5, "max_tokens": 4}, None, "min_tokens: 5 is more than max_tokens 4"),
        ({"min_tokens": 600}, None, "min_tokens: 600 is more than max_tokens 511"),  # the rest of the context
        (
            {"structured_outputs": {"json_object": True}, "ignore_eos": True},
            None,
            "ignore_eos: a structured output ends with EOS when its grammar is complete",
        ),
        (
            {"max_tokens": 0, "n": 0, "bogus": 1},
            "max_tokens",
            "max_tokens: Input should be greater than or equal to 1 (and 2 more error(s))",
        ),
    ],
)
def test_a_bad_field_gets_the_same_400(prepare_body, extra, param, message):
    with pytest.raises(APIError) as info:
        prepare_body({"prompt": "hi", **extra})
    assert (info.value.status_code, info.value.param, info.value.message) == (400, param, message)


def test_the_engine_gets_the_sampling_fields_and_the_request_its_own(prepare_body):
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "n": 2,
        "temperature": 0.5,
        "seed": 3,
        "stop": "x",
        "logit_bias": {"7": 1.5},
        "min_tokens": 2,
        "cache_salt": "tenant",
        "request_id": "r1",
    }
    prepared = prepare_body(body)
    request = GenerateRequest.model_validate(body)
    want = SamplingParams(
        max_tokens=prepared.max_tokens,
        n=2,
        temperature=0.5,
        seed=3,
        stop=["x"],
        logit_bias={7: 1.5},
        min_tokens=2,
        structured_outputs=request.tool_constraint(),
    )
    assert prepared.params == want and isinstance(prepared.params.structured_outputs, StructuredOutputs)
    assert prepared.engine_input() == EngineInput(prepared.prompt_token_ids, want, "r1", "tenant", None, None), (
        "the engine input carries the prepared request whole"
    )


def test_a_prepared_request_converts_to_one_engine_input():
    params = SamplingParams(max_tokens=3)
    prepared = PreparedRequest("r", [1, 2], params, cache_salt="s", lora_name="a", lora_path="/p")
    assert prepared.engine_input() == EngineInput([1, 2], params, "r", "s", "a", "/p")
