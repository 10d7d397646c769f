"""Malformed and hostile requests against one tiny app on real Serve: each gets its 4xx and an error
body naming the problem, and the app keeps serving with every KV block back. Also: the same limits
on the Python handle (typed errors, never a hang), API keys and CORS (a second app)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import tiny_config
from ray import serve

from deployments.errors import APIError
from deployments.protocol import GenerateRequest

APP = "hostile"
HI = [{"role": "user", "content": "hi"}]
# tiny-llama admits 2048 tokens per request: the default limits derive from it.
MAX_MODEL_LEN, PROMPT_CHARS, BODY_BYTES = 2048, 2048 * 32, 2048 * 32 + 64 * 1024


@pytest.fixture(scope="module")
def app_url(serve_cluster) -> str:
    yield serve_cluster.deploy(APP, tiny_config())
    serve_cluster.delete(APP)  # its replica's memory goes back to later tests


def C(**fields) -> dict:  # a completions body
    return {"prompt": "hi", "max_tokens": 2, **fields}


def CH(**fields) -> dict:  # a chat body
    return {"messages": HI, "max_tokens": 2, **fields}


def raw(text: str) -> bytes:
    return text.encode()


JSON = {"content-type": "application/json"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# (id, method, path, json body or raw bytes, extra headers, status, substring of message or param)
TABLE = [
    # prompts of the wrong shape, empty, too long, or with token ids outside the vocabulary
    ("prompt-int", "POST", COMPLETIONS, C(prompt=5), {}, 400, "prompt"),
    ("prompt-dict", "POST", COMPLETIONS, C(prompt={"a": 1}), {}, 400, "prompt"),
    ("prompt-null", "POST", COMPLETIONS, C(prompt=None), {}, 400, "prompt"),
    ("prompt-missing", "POST", COMPLETIONS, {"max_tokens": 2}, {}, 400, "prompt"),
    ("prompt-empty", "POST", COMPLETIONS, C(prompt=""), {}, 400, "empty"),
    ("prompt-empty-list", "POST", COMPLETIONS, C(prompt=[]), {}, 400, "empty"),
    ("prompt-list-of-strings", "POST", COMPLETIONS, C(prompt=["a", "b"]), {}, 400, "one prompt"),
    ("prompt-list-of-id-lists", "POST", COMPLETIONS, C(prompt=[[1, 2], [3]]), {}, 400, "one prompt"),
    ("prompt-float-ids", "POST", COMPLETIONS, C(prompt=[1.5, 2]), {}, 400, "prompt"),
    ("prompt-negative-id", "POST", COMPLETIONS, C(prompt=[1, -1]), {}, 400, "token id -1"),
    ("prompt-id-at-vocab", "POST", COMPLETIONS, C(prompt=[49152]), {}, 400, "out of the vocabulary [0, 49152)"),
    ("prompt-huge-id", "POST", COMPLETIONS, C(prompt=[10**30]), {}, 400, "out of the vocabulary"),
    ("prompt-too-many-ids", "POST", COMPLETIONS, C(prompt=[1] * 3000), {}, 400, "max_model_len 2048"),
    (
        "prompt-too-many-chars",
        "POST",
        COMPLETIONS,
        C(prompt="x" * (PROMPT_CHARS + 1)),
        {},
        400,
        "ingress.limits.max_prompt_chars",
    ),
    ("prompt-too-many-tokens", "POST", COMPLETIONS, C(prompt="hello " * 2100), {}, 400, "max_model_len 2048"),
    (
        "prompt-lone-surrogate",
        "POST",
        COMPLETIONS,
        raw('{"prompt": "\\ud800", "max_tokens": 2}'),
        JSON,
        400,
        "not valid Unicode",
    ),
    # max_tokens and sampling ranges
    ("max-tokens-negative", "POST", COMPLETIONS, C(max_tokens=-1), {}, 400, "max_tokens"),
    ("max-tokens-string", "POST", COMPLETIONS, C(max_tokens="ten"), {}, 400, "max_tokens"),
    ("max-tokens-float", "POST", COMPLETIONS, C(max_tokens=1.5), {}, 400, "max_tokens"),
    ("max-tokens-huge", "POST", COMPLETIONS, C(max_tokens=10**20), {}, 400, "max_model_len 2048"),
    (
        "max-tokens-past-context",
        "POST",
        COMPLETIONS,
        C(prompt="hello " * 10, max_tokens=2040),
        {},
        400,
        "max_model_len",
    ),
    ("temperature-nan", "POST", COMPLETIONS, raw('{"prompt": "hi", "temperature": NaN}'), JSON, 400, "temperature"),
    (
        "temperature-infinity",
        "POST",
        COMPLETIONS,
        raw('{"prompt": "hi", "temperature": Infinity}'),
        JSON,
        400,
        "finite number",
    ),
    (
        "temperature-minus-infinity",
        "POST",
        COMPLETIONS,
        raw('{"prompt": "hi", "temperature": -Infinity}'),
        JSON,
        400,
        "temperature",
    ),
    ("temperature-too-high", "POST", COMPLETIONS, C(temperature=101), {}, 400, "temperature"),
    ("temperature-string", "POST", COMPLETIONS, C(temperature="hot"), {}, 400, "temperature"),
    ("top-p-nan", "POST", COMPLETIONS, raw('{"prompt": "hi", "top_p": NaN}'), JSON, 400, "top_p"),
    ("top-p-above-one", "POST", COMPLETIONS, C(top_p=1.5), {}, 400, "top_p"),
    ("top-k-negative", "POST", COMPLETIONS, C(top_k=-1), {}, 400, "top_k"),
    ("top-k-past-vocab", "POST", COMPLETIONS, C(top_k=10**6), {}, 400, "vocabulary (49152"),
    ("seed-past-int64", "POST", COMPLETIONS, C(seed=2**64), {}, 400, "64-bit"),
    ("seed-below-int64", "POST", COMPLETIONS, C(seed=-(2**63) - 1), {}, 400, "64-bit"),
    ("seed-string", "POST", COMPLETIONS, C(seed="abc"), {}, 400, "seed"),
    ("seed-float", "POST", COMPLETIONS, C(seed=1.5), {}, 400, "seed"),
    (
        "presence-penalty-nan",
        "POST",
        COMPLETIONS,
        raw('{"prompt": "hi", "presence_penalty": NaN}'),
        JSON,
        400,
        "presence_penalty",
    ),
    (
        "logit-bias-past-vocab",
        "POST",
        COMPLETIONS,
        C(logit_bias={"49152": 100}),
        {},
        400,
        "logit_bias: token id 49152 is out of the vocabulary [0, 49152)",
    ),
    (
        "logit-bias-too-many",
        "POST",
        CHAT,
        CH(logit_bias={str(t): 1 for t in range(301)}),
        {},
        400,
        "ingress.limits.max_logit_bias = 300",
    ),
    ("logit-bias-too-large", "POST", COMPLETIONS, C(logit_bias={"1": 101}), {}, 400, "logit_bias"),
    (
        "logit-bias-infinity",
        "POST",
        COMPLETIONS,
        raw('{"prompt": "hi", "logit_bias": {"1": Infinity}}'),
        JSON,
        400,
        "logit_bias",
    ),
    # stop strings, logprobs, user
    (
        "stop-too-many",
        "POST",
        COMPLETIONS,
        C(stop=[f"s{i}" for i in range(17)]),
        {},
        400,
        "ingress.limits.max_stop = 16",
    ),
    ("stop-thousand", "POST", CHAT, CH(stop=["x"] * 1000), {}, 400, "ingress.limits.max_stop"),
    ("stop-too-long", "POST", COMPLETIONS, C(stop="x" * 300), {}, 400, "ingress.limits.max_stop_chars = 256"),
    ("stop-empty-string", "POST", COMPLETIONS, C(stop=[""]), {}, 400, "must not be empty"),
    ("stop-ints", "POST", COMPLETIONS, C(stop=[1, 2]), {}, 400, "stop"),
    ("stop-dict", "POST", COMPLETIONS, C(stop={"a": 1}), {}, 400, "stop"),
    ("logprobs-too-many", "POST", COMPLETIONS, C(logprobs=21), {}, 400, "logprobs"),
    ("logprobs-negative", "POST", COMPLETIONS, C(logprobs=-1), {}, 400, "logprobs"),
    ("top-logprobs-too-many", "POST", CHAT, CH(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("chat-logprobs-list", "POST", CHAT, CH(logprobs=[1]), {}, 400, "logprobs"),
    ("user-too-long", "POST", COMPLETIONS, C(user="u" * 300), {}, 400, "ingress.limits.max_user_chars = 256"),
    ("chat-user-too-long", "POST", CHAT, CH(user="u" * 300), {}, 400, "max_user_chars"),
    ("user-int", "POST", COMPLETIONS, C(user=5), {}, 400, "user"),
    # unsupported options, unknown fields, wrong types
    ("n-over-limit", "POST", COMPLETIONS, C(n=9), {}, 400, "ingress.limits.max_n = 8"),
    ("n-huge", "POST", CHAT, CH(n=10**9), {}, 400, "n: Input should be less than or equal to 128"),
    ("echo", "POST", COMPLETIONS, C(echo=True), {}, 400, "echo"),
    ("best-of", "POST", COMPLETIONS, C(best_of=3), {}, 400, "best_of"),
    ("unknown-field", "POST", COMPLETIONS, C(foo=1), {}, 400, "foo"),
    ("unknown-field-huge-name", "POST", COMPLETIONS, C(**{"f" * 5000: 1}), {}, 400, "(5000 characters)"),
    ("stream-not-bool", "POST", COMPLETIONS, C(stream="maybe"), {}, 400, "stream"),
    (
        "stream-options-unknown",
        "POST",
        COMPLETIONS,
        C(stream=True, stream_options={"bogus": 1}),
        {},
        400,
        "stream_options.bogus",
    ),
    ("stream-stop-too-many", "POST", COMPLETIONS, C(stream=True, stop=["x"] * 17), {}, 400, "max_stop"),
    # model names: only the served name, never a path
    ("model-path-traversal", "POST", COMPLETIONS, C(model="../../etc/passwd"), {}, 404, "does not exist"),
    ("model-absolute-path", "POST", CHAT, CH(model="/tmp/x"), {}, 404, "does not exist"),
    ("model-hub-id", "POST", COMPLETIONS, C(model="meta-llama/Llama-3-8B"), {}, 404, "does not exist"),
    ("model-huge", "POST", COMPLETIONS, C(model="m" * 50_000), {}, 404, "(50000 characters)"),
    ("model-nul", "POST", COMPLETIONS, C(model="tiny-llama\x00"), {}, 404, "does not exist"),
    ("model-int", "POST", COMPLETIONS, C(model=5), {}, 400, "model"),
    # chat messages
    ("messages-empty", "POST", CHAT, CH(messages=[]), {}, 400, "messages"),
    ("messages-string", "POST", CHAT, CH(messages="hi"), {}, 400, "messages"),
    ("messages-missing", "POST", CHAT, {"max_tokens": 2}, {}, 400, "messages"),
    ("message-unknown-role", "POST", CHAT, CH(messages=[{"role": "wizard", "content": "hi"}]), {}, 400, "role"),
    ("message-no-role", "POST", CHAT, CH(messages=[{"content": "hi"}]), {}, 400, "role"),
    ("message-content-int", "POST", CHAT, CH(messages=[{"role": "user", "content": 5}]), {}, 400, "content"),
    (
        "message-image-part",
        "POST",
        CHAT,
        CH(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]),
        {},
        400,
        "content",
    ),
    ("messages-too-many", "POST", CHAT, CH(messages=HI * 1025), {}, 400, "ingress.limits.max_messages = 1024"),
    (
        "message-parts-too-many",
        "POST",
        CHAT,
        CH(messages=[{"role": "user", "content": [{"text": "a"}] * 1025}]),
        {},
        400,
        "max_messages",
    ),
    (
        "messages-too-many-chars",
        "POST",
        CHAT,
        CH(messages=[{"role": "user", "content": "x" * 40_000}] * 2),
        {},
        400,
        "ingress.limits.max_prompt_chars",
    ),
    ("max-completion-tokens-zero", "POST", CHAT, CH(max_completion_tokens=0), {}, 400, "max_completion_tokens"),
    (
        "chat-temperature-infinity",
        "POST",
        CHAT,
        raw(json.dumps(CH())[:-1] + ', "temperature": Infinity}'),
        JSON,
        400,
        "temperature",
    ),
    # bodies: broken, not JSON, not UTF-8, too large
    ("json-broken", "POST", COMPLETIONS, raw('{"prompt": "hi"'), JSON, 400, "invalid JSON"),
    ("json-garbage", "POST", COMPLETIONS, raw("{not json"), JSON, 400, "invalid JSON"),
    ("json-empty-body", "POST", COMPLETIONS, b"", JSON, 400, "request body: Field required"),
    ("json-array", "POST", COMPLETIONS, raw("[1, 2]"), JSON, 400, "dictionary"),
    ("json-string", "POST", CHAT, raw('"hello"'), JSON, 400, "dictionary"),
    ("json-invalid-utf8", "POST", COMPLETIONS, b'{"prompt": "\xff\xfe"}', JSON, 400, "UnicodeDecodeError"),
    (
        "content-type-text",
        "POST",
        COMPLETIONS,
        raw(json.dumps(C())),
        {"content-type": "text/plain"},
        400,
        "must be JSON sent with Content-Type: application/json (got 'text/plain')",
    ),
    ("content-type-missing", "POST", COMPLETIONS, raw(json.dumps(C())), {"content-type": ""}, 400, "got 'none'"),
    (
        "body-too-large",
        "POST",
        COMPLETIONS,
        C(prompt="x" * BODY_BYTES),
        {},
        413,
        f"ingress.limits.max_body_bytes = {BODY_BYTES}",
    ),
    ("body-too-large-chunked", "POST", CHAT, iter([b" " * 65536] * 16), JSON, 413, "more than"),
    # methods and paths
    ("get-completions", "GET", COMPLETIONS, None, {}, 405, "Method Not Allowed"),
    ("put-chat", "PUT", CHAT, CH(), {}, 405, "Method Not Allowed"),
    ("delete-models", "DELETE", "/v1/models", None, {}, 405, "Method Not Allowed"),
    ("unknown-path", "GET", "/v1/nothing", None, {}, 404, "Not Found"),
    ("unknown-version", "POST", "/v2/completions", C(), {}, 404, "Not Found"),
    ("encoded-traversal", "GET", "/v1/%2e%2e/%2e%2e/etc/passwd", None, {}, 404, "Not Found"),
]


def _send(client: httpx.Client, url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body} if body is not None else {}
    return client.request(method, url + path, headers=headers, **kwargs)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    "method,path,body,headers,status,needle", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_hostile_request_gets_its_status_and_a_named_error(
    app_url, client, method, path, body, headers, status, needle
):
    r = _send(client, app_url, method, path, body, headers)
    assert r.status_code == status, r.text[:500]
    err = _error(r)
    assert needle in err["message"] or needle in (err["param"] or ""), err
    assert len(r.content) < 2000  # nothing the client sent is echoed back in bulk


def test_a_declared_64mb_body_is_refused_before_it_is_sent(app_url):
    """Content-Length: 64 MiB and no body at all: the 413 comes back without a byte of it read (a
    server waiting for the body would answer nothing, and recv would time out)."""
    parts = urlsplit(app_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as s:
        s.sendall(
            f"POST {parts.path}{COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {64 * 2**20}\r\n\r\n".encode()
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = s.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"ingress.limits.max_body_bytes" in reply


def test_still_serving_with_every_kv_block_free(app_url, client):
    for body in (C(prompt="Hello there", max_tokens=8, ignore_eos=True), CH(max_tokens=8, ignore_eos=True)):
        path = COMPLETIONS if "prompt" in body else CHAT
        r = client.post(app_url + path, json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    stats = serve.get_deployment_handle("LLMServer", APP).stats.remote().result(timeout_s=30)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


# ---- the Python handle: same limits, typed errors, never a hang -----------------------------------

HOSTILE_HANDLE_CALLS = [
    ({"prompt": "x", "stop": ["a"] * 100}, "max_stop"),
    ({"prompt": "x" * (PROMPT_CHARS + 1)}, "max_prompt_chars"),
    ({"messages": HI * 2000}, "max_messages"),
    ({"prompt": [10**9]}, "out of the vocabulary"),
    ({"prompt": "x", "seed": 2**64}, "64-bit"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"prompt": "x", "request_id": "r" * 10_000}, "max_request_id_chars"),
    ({"prompt": "x", "prompt_token_ids": [-5]}, "prompt_token_ids"),  # token ids come from the ingress only
    ("just a string", "GenerateRequest"),
    (None, "GenerateRequest"),
]


@pytest.mark.parametrize("request_,needle", HOSTILE_HANDLE_CALLS)
def test_hostile_handle_calls_raise_typed_errors(app_url, request_, needle):
    handle = serve.get_app_handle(APP)
    with pytest.raises(APIError) as info:
        handle.generate.remote(request_).result(timeout_s=30)
    assert info.value.status_code == 400 and needle in str(info.value)

    def first_chunk():
        return next(iter(handle.options(stream=True).stream.remote(request_)))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(APIError) as info:
            pool.submit(first_chunk).result(timeout=30)
    assert info.value.status_code == 400 and needle in str(info.value)


def test_handle_still_serves_a_typed_request(app_url):
    out = (
        serve.get_app_handle(APP)
        .generate.remote(GenerateRequest(prompt="Hello", max_tokens=4, ignore_eos=True))
        .result(timeout_s=60)
    )
    assert out.completion_tokens == 4


# ---- API keys and CORS (a second app) ------------------------------------------------------------

KEYS = ("sk-test-one", "sk-test-two")
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def secured_url(serve_cluster, tmp_path_factory) -> str:
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text("\n".join(KEYS) + "\n")
    config = tiny_config()
    config["ingress"] = {"api_key_file": str(key_file), "cors_allow_origins": [ORIGIN]}
    url = serve_cluster.deploy("secured", config)
    yield url
    serve_cluster.delete("secured")


@pytest.mark.parametrize(
    "headers,ok",
    [
        ({"Authorization": f"Bearer {KEYS[0]}"}, True),
        ({"Authorization": f"Bearer {KEYS[1]}"}, True),
        ({}, False),
        ({"Authorization": "Bearer sk-wrong"}, False),
        ({"Authorization": f"Basic {KEYS[0]}"}, False),
        ({"Authorization": f"Bearer {KEYS[0]}x"}, False),
    ],
)
def test_api_key_required_on_v1(secured_url, client, headers, ok):
    r = client.post(secured_url + COMPLETIONS, json=C(), headers=headers)
    if ok:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        return
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = _error(r)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert "sk-" not in r.text  # neither the wrong key nor a right one is echoed


def test_api_key_covers_every_path_but_health(secured_url, client):
    assert client.get(secured_url + "/health").status_code == 200
    assert client.get(secured_url + "/v1/models").status_code == 401
    good = {"Authorization": f"Bearer {KEYS[0]}"}
    assert client.get(secured_url + "/v1/models", headers=good).json()["data"][0]["id"] == "tiny-llama"
    # Without a key, even a huge body is refused for the key, not read.
    assert client.post(secured_url + COMPLETIONS, json=C(prompt="x" * BODY_BYTES)).status_code == 401


def test_no_cors_headers_by_default(app_url, client):
    r = client.get(app_url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = client.options(app_url + CHAT, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_for_the_configured_origin(secured_url, client):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = client.options(secured_url + CHAT, headers=preflight)  # preflight: no key needed
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = client.post(secured_url + COMPLETIONS, json=C(), headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # refusals readable too
    r = client.options(secured_url + CHAT, headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
