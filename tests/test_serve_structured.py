"""Structured outputs and tool calling as users call them: the official openai client's `parse`,
LangChain's structured output and tool binding (streaming too), raw HTTP for vLLM's
`structured_outputs`, and Python handles; bad constraints are 400s naming the field, and the
server keeps serving. Real Ray, real Serve, the embedded model."""

from __future__ import annotations

import json
import re
from typing import List, Literal, Optional

import httpx
import jsonschema
import openai
import pytest
from conftest import SMOL
from pydantic import BaseModel, Field
from ray import serve

from deployments.protocol import GenerateRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


class City(BaseModel):
    name: str
    country: str
    population: int
    landmarks: List[str] = Field(max_length=3)  # the embedded 135M model would list the same one forever
    climate: Literal["oceanic", "continental", "mediterranean"]
    mayor: Optional[str] = None


@pytest.fixture(scope="module")
def client(smol_app):
    return openai.OpenAI(base_url=f"{smol_app}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=SMOL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, City) and message.parsed.name


def test_json_object_and_vllm_structured_outputs_over_http(smol_app, client):
    out = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "A JSON object, please."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert out.choices[0].message.content.startswith("{")
    r = httpx.post(
        f"{smol_app}/v1/completions",
        timeout=120,
        json={
            "prompt": "The date today is",
            "max_tokens": 20,
            "temperature": 0,
            "structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"},
        },
    )
    assert r.status_code == 200 and re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", r.json()["choices"][0]["text"])
    stream = client.chat.completions.create(
        model=SMOL,
        messages=ASK,
        temperature=1.0,
        seed=7,
        n=3,
        stream=True,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1, 2] and all(t in ("sunny", "rainy") for t in texts.values())


def test_python_handles_take_structured_outputs(smol_app):
    handle = serve.get_app_handle("smol")
    request = GenerateRequest(
        prompt="Yes or no?", max_tokens=5, temperature=0, structured_outputs={"choice": ["yes", "no"]}
    )
    assert handle.generate.remote(request).result().text in ("yes", "no")


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "frob"}}}}},
            "structured_outputs",
            "frob",
        ),
        ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs", "root"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None, "exactly one"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "deep",
                        "schema": {
                            "type": "object",
                            "properties": {"a": json.loads('{"type": "array", "items": ' * 40 + "{}" + "}" * 40)},
                        },
                    },
                }
            },
            "structured_outputs",
            "max_schema_depth",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not in tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            None,
            "constrains",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(smol_app, body, param, words):
    r = httpx.post(f"{smol_app}/v1/chat/completions", timeout=120, json={"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if param:
        assert error["param"] == param
    ok = httpx.post(f"{smol_app}/v1/chat/completions", timeout=120, json={"messages": ASK, "max_tokens": 3})
    assert ok.status_code == 200


def test_required_and_named_tool_calls_always_parse(client):
    out = client.chat.completions.create(
        model=SMOL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=80
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    named = dict(
        model=SMOL,
        messages=ASK,
        tools=[WEATHER, TIME],
        temperature=0,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**named).choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(whole.function.arguments), WEATHER["function"]["parameters"])
    pieces, names, finish = [], set(), None
    for chunk in client.chat.completions.create(**named, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                names.add(d.function.name) if d.function.name else None
                pieces.append(d.function.arguments or "")
            finish = c.finish_reason or finish
    assert names == {"get_weather"} and finish == "tool_calls"
    assert len(pieces) > 2 and "".join(pieces) == whole.function.arguments  # streamed in pieces, same arguments


def test_tool_results_go_back_through_the_template(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model=SMOL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30)
    choice = out.choices[0]
    # auto: the embedded model answers in words here (or calls again: then the calls parse)
    assert choice.message.content or choice.message.tool_calls
    usage = out.usage.prompt_tokens
    bare = client.chat.completions.create(model=SMOL, messages=ASK, temperature=0, max_tokens=1).usage.prompt_tokens
    assert usage > bare + 40  # the tools' schemas and the tool turns are in the prompt


def test_langchain_structured_output_and_tool_binding(smol_app):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{smol_app}/v1",
        api_key="unused",
        model=SMOL,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        timeout=120,
    )
    city = llm.with_structured_output(City).invoke("Describe Rome as JSON.")
    assert isinstance(city, City) and city.name

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        return "sunny"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Oslo?")
    assert message.tool_calls[0]["name"] == "get_weather" and set(message.tool_calls[0]["args"]) == {"city", "unit"}
    streamed = None
    for chunk in bound.stream("What is the weather in Oslo?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]
