"""The ingress's guards without Ray: request limits, the body-size and API-key middlewares, key loading."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from deployments.auth import APIKeyAuth, APIKeyConfigError, APIKeys, load_api_keys
from deployments.config import AppConfig, LimitsConfig
from deployments.errors import APIError, validation_error
from deployments.limits import BodySizeLimit, RequestLimits
from deployments.protocol import GenerateRequest

LIMITS = RequestLimits(LimitsConfig(), max_model_len=2048, vocab_size=1000)


def _refused(request: dict, limits: RequestLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as info:
        r = GenerateRequest(**request)
        limits.check_request(r)
        limits.check_tokens(r.prompt_param, r.prompt if isinstance(r.prompt, list) else [])
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize(
    "request_,param,named",
    [
        ({"prompt": "x", "stop": ["s"] * 17}, "stop", "ingress.limits.max_stop = 16"),
        ({"prompt": "x", "stop": ["s" * 257]}, "stop", "ingress.limits.max_stop_chars = 256"),
        ({"prompt": "x", "stop_token_ids": list(range(17))}, "stop_token_ids", "max_stop"),
        ({"prompt": "x", "stop_token_ids": [1000]}, "stop_token_ids", "[0, 1000)"),
        ({"prompt": "x" * 65537}, "prompt", "ingress.limits.max_prompt_chars = 65536"),
        ({"prompt": list(range(2049))}, "prompt", "max_model_len 2048"),
        ({"prompt": [1, -1]}, "prompt", "token id -1"),
        ({"prompt": [10**30]}, "prompt", "out of the vocabulary"),
        ({"messages": [{"role": "user", "content": "x"}] * 1025}, "messages", "ingress.limits.max_messages = 1024"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}] * 1025}]}, "messages.0.content", "max_messages"),
        ({"messages": [{"role": "user", "content": "x" * 40000}] * 2}, "messages", "80000 characters"),
        ({"prompt": "x", "top_k": 1001}, "top_k", "vocabulary (1000"),
        ({"prompt": "x", "max_tokens": 2049}, "max_tokens", "max_model_len 2048"),
        ({"prompt": "x", "request_id": "r" * 257}, "request_id", "max_request_id_chars = 256"),
        ({"prompt": "a\ud800"}, "prompt", "not valid Unicode"),
        (
            {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}]},
            "messages.1.content",
            "not valid Unicode",
        ),
    ],
)
def test_each_limit_is_a_400_naming_field_and_limit(request_, param, named):
    err = _refused(request_)
    assert err.param == param and named in err.message and err.message.startswith(param)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_past_64_bits_fails_validation_naming_the_range(seed):
    # checked by SamplingParams itself, so a caller reaching the LLM deployment directly is refused too
    with pytest.raises(ValueError, match="64-bit integer") as info:
        GenerateRequest(prompt="x", seed=seed)
    assert validation_error(info.value).param == "seed"
    GenerateRequest(prompt="x", seed=2**64 - 1)  # the largest torch.Generator takes


def test_limits_follow_the_config():
    tight = RequestLimits(LimitsConfig(max_stop=1, max_top_logprobs=2, max_prompt_chars=10), 2048, 1000)
    assert "max_stop = 1" in _refused({"prompt": "x", "stop": ["a", "b"]}, tight).message
    assert "max_top_logprobs = 2" in _refused({"prompt": "x", "logprobs": 3}, tight).message
    assert _refused({"prompt": "x" * 11}, tight).param == "prompt"
    tight.check_request(GenerateRequest(prompt="x" * 10, stop=["a"], logprobs=2))  # at the limit: fine


def test_within_limits_passes():
    r = GenerateRequest(prompt=[0, 999], stop=["s"] * 16, seed=2**63 - 1, top_k=1000, max_tokens=2046, logprobs=20)
    LIMITS.check_request(r)
    LIMITS.check_tokens("prompt", [0, 999])
    LIMITS.check_user("u" * 256)
    with pytest.raises(APIError, match="max_user_chars = 256"):
        LIMITS.check_user("u" * 257)


def _app(*middleware) -> TestClient:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    for cls, kwargs in middleware:
        app.add_middleware(cls, **kwargs)
    return TestClient(app)


def _limit(n: int):
    async def max_bytes() -> int:
        return n

    return BodySizeLimit, {"max_bytes": max_bytes}


def test_body_over_the_limit_is_413_before_the_app_reads_it():
    client = _app(_limit(1000))
    assert client.post("/v1/echo", content=b"x" * 1000).json() == {"bytes": 1000}
    r = client.post("/v1/echo", content=b"x" * 1001)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert "ingress.limits.max_body_bytes = 1000" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # no body: passes straight through


def _chunked(middleware, chunks: int, size: int = 100):
    """Drives `middleware` over raw ASGI with a chunked body: how many chunks it read, what it sent."""
    read, sent = 0, []

    async def receive():
        nonlocal read
        read += 1
        return {"type": "http.request", "body": b"x" * size, "more_body": read < chunks}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo", "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(middleware(scope, receive, send))
    return read, sent


def test_chunked_body_is_refused_once_past_the_limit():
    got = []

    async def app(scope, receive, send):
        got.append(await receive())

    cls, kwargs = _limit(1000)
    read, sent = _chunked(cls(app, **kwargs), chunks=10_000)
    assert read == 11 and not got  # stopped at 1100 bytes, the app never ran
    assert sent[0]["status"] == 413 and b"more than 1100 bytes" in sent[1]["body"]

    read, sent = _chunked(cls(app, **kwargs), chunks=10)  # 1000 bytes: allowed, replayed as one message
    assert read == 10 and got == [{"type": "http.request", "body": b"x" * 1000, "more_body": False}]


def test_derived_limits_admit_the_largest_allowed_request_and_grow_with_the_context():
    """Unset, the prompt and body limits come from the context window: a request at every field limit
    passes the body-size middleware and the checks, one more prompt character is refused, and a
    longer window admits what a shorter one refuses. A configured body limit wins."""
    wide = RequestLimits(LimitsConfig(), max_model_len=4096, vocab_size=1000)
    for limits in (LIMITS, wide):
        c = limits.config
        largest = {
            "prompt": "x" * limits.max_prompt_chars,
            "stop": ["s" * c.max_stop_chars] * c.max_stop,
            "user": "u" * c.max_user_chars,
            "max_tokens": 1,
        }
        client = _app(_limit(limits.max_body_bytes))
        assert client.post("/v1/echo", json=largest).status_code == 200
        limits.check_user(largest.pop("user"))
        limits.check_request(GenerateRequest(**largest))
        _refused({**largest, "prompt": largest["prompt"] + "x"}, limits)
    wide.check_request(GenerateRequest(prompt="x" * (LIMITS.max_prompt_chars + 1)))
    assert wide.max_body_bytes > LIMITS.max_body_bytes
    fixed = RequestLimits(LimitsConfig(max_body_bytes=4096), 2048, 1000)
    client = _app(_limit(fixed.max_body_bytes))
    assert client.post("/v1/echo", content=b"x" * 4096).status_code == 200
    assert client.post("/v1/echo", content=b"x" * 4097).status_code == 413


def test_api_keys(tmp_path, monkeypatch):
    keys = APIKeys(["k1", "k2"])
    client = _app((APIKeyAuth, {"keys": keys}))
    assert client.post("/v1/echo", content=b"ab", headers={"Authorization": "Bearer k2"}).json() == {"bytes": 2}
    assert client.post("/v1/echo", headers={"Authorization": "bearer k1"}).status_code == 200
    for headers in (
        {},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic k1"},
        {"Authorization": "Bearer k3"},
        {"Authorization": "Bearer k1k2"},
    ):
        r = client.post("/v1/echo", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert "k3" not in r.text and "k1k2" not in r.text
    assert client.get("/health").status_code == 200
    assert "k1" not in repr(keys) and repr(keys) == "APIKeys(2 keys)"


def test_api_keys_load_from_env_and_file(tmp_path, monkeypatch):
    assert load_api_keys(None, None) is None
    key_file = tmp_path / "keys"
    key_file.write_text("alpha\n\n  beta  \n")
    monkeypatch.setenv("TEST_KEYS", "gamma, delta")
    keys = load_api_keys("TEST_KEYS", str(key_file))
    assert len(keys) == 4 and all(keys.accepts(k) for k in (b"alpha", b"beta", b"gamma", b"delta"))
    assert not keys.accepts(b"") and not keys.accepts(b"alph")

    monkeypatch.setenv("EMPTY_KEYS", " ")
    with pytest.raises(APIKeyConfigError, match="EMPTY_KEYS, which is unset or empty"):
        load_api_keys("EMPTY_KEYS", None)
    with pytest.raises(APIKeyConfigError, match="cannot be read: FileNotFoundError"):
        load_api_keys(None, str(tmp_path / "missing"))
    (tmp_path / "blank").write_text("\n \n")
    with pytest.raises(APIKeyConfigError, match="none was found"):
        load_api_keys(None, str(tmp_path / "blank"))


def test_config_holds_no_keys_and_its_limits_reach_the_checks():
    cfg = AppConfig.model_validate({"ingress": {"api_keys_env": "MY_KEYS", "limits": {"max_stop": 4}}})
    limits = RequestLimits(cfg.ingress.limits, 2048, 1000)
    limits.check_request(GenerateRequest(prompt="x", stop=["s"] * 4))
    assert "ingress.limits.max_stop = 4" in _refused({"prompt": "x", "stop": ["s"] * 5}, limits).message
    with pytest.raises(ValueError, match="api_keys"):  # keys only by env var name or file path
        AppConfig.model_validate({"ingress": {"api_keys": ["sk-inline"]}})
    with pytest.raises(ValueError, match="max_stops"):
        AppConfig.model_validate({"ingress": {"limits": {"max_stops": 4}}})
