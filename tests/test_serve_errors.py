"""Every error class of the HTTP API: status code and OpenAI's error body."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import TINY


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=60)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "hi", "max_token": 5}, "max_token"),  # typo: refused, named
        ("completions", {"max_tokens": 5}, "prompt"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_validation_is_400_naming_the_field(tiny_app, path, body, param):
    r = _post(tiny_app, path, body)
    assert r.status_code == 400
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"]


def test_unsupported_option_is_400(tiny_app):
    r = _post(tiny_app, "completions", {"prompt": "hi", "best_of": 2})
    assert r.status_code == 400 and "best_of" in _error(r)["message"]


def test_malformed_json_is_400(tiny_app):
    r = httpx.post(
        f"{tiny_app}/v1/completions", content=b"{not json", timeout=60, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and _error(r)["type"] == "invalid_request_error"


def test_unknown_model_is_404(tiny_app):
    r = _post(tiny_app, "chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    err = _error(r)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]


def test_unknown_path_is_404_with_error_body(tiny_app):
    r = httpx.get(f"{tiny_app}/v1/nothing", timeout=60)
    assert r.status_code == 404 and _error(r)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_is_400_naming_the_limit(tiny_app, stream):
    r = _post(tiny_app, "completions", {"prompt": "hello " * 10, "max_tokens": 4000, "stream": stream})
    assert r.status_code == 400  # a stream fails before its first byte, so the status is still honest
    err = _error(r)
    assert err["code"] == "context_length_exceeded"
    assert "max_model_len" in err["message"] and "2048" in err["message"]


def test_openai_client_raises_typed_errors(tiny_app):
    client = openai.OpenAI(base_url=f"{tiny_app}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|max_model_len"):
        client.completions.create(model=TINY, prompt="hi", max_tokens=100_000)


def test_overload_is_429_with_retry_after(overload_app):
    """One replica with max_ongoing_requests=1 and max_queued_requests=1: of six concurrent long
    requests, the ingress refuses the excess with OpenAI's body (a raw BackPressureError would be a 500)."""
    body = {"prompt": "hi", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def one(client: httpx.AsyncClient, stream: bool) -> httpx.Response:
        r = await client.post(f"{overload_app}/v1/completions", json={**body, "stream": stream})
        await r.aread()
        return r

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i % 2 == 1) for i in range(6)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses, statuses
    assert set(statuses) <= {200, 429}, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            err = _error(r)
            assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
