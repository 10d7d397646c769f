"""What one request may ask of the server: the ingress's checks against `ingress.limits`.

Cheap checks run before tokenizing (sizes of text and lists), the token checks right after, so a
hostile request costs the ingress little and never reaches a replica. Each refusal is a 400 that
names the request field (`param`) and the limit (`ingress.limits.<name>`), so a client knows what to
change and an operator which knob to turn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Awaitable, Callable, List, Optional

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments import metrics
from deployments.config import LimitsConfig
from deployments.errors import APIError
from deployments.protocol import GenerateRequest

BODY_OVERHEAD_BYTES = 64 * 1024  # the JSON around the prompt: sampling fields, stop strings, roles


def limit_error(param: str, what: str, name: str, value) -> APIError:
    return APIError(
        400, f"{param}: {what}, more than the limit ingress.limits.{name} = {value}", param=param, code="limit_exceeded"
    )


@dataclass(frozen=True)
class RequestLimits:
    """LimitsConfig with the context-derived defaults resolved (max_model_len is the longest
    prompt + max_tokens a replica admits) and the tokenizer's vocabulary size."""

    config: LimitsConfig
    max_model_len: int
    vocab_size: int

    @property
    def max_body_bytes(self) -> int:
        return body_limit(self.config, self.max_model_len)

    @property
    def max_prompt_chars(self) -> int:
        return self.config.max_prompt_chars or self.max_model_len * self.config.bytes_per_token

    # ---- checks ----------------------------------------------------------------------------------

    def check_user(self, user: Optional[str]) -> None:
        """The OpenAI `user` field (HTTP only)."""
        if user is not None and len(user) > self.config.max_user_chars:
            raise limit_error("user", f"{len(user)} characters", "max_user_chars", self.config.max_user_chars)

    def check_request(self, request: GenerateRequest) -> None:
        """Everything checkable before tokenizing: sizes, counts, ranges."""
        c = self.config
        if request.request_id is not None and len(request.request_id) > c.max_request_id_chars:
            raise limit_error(
                "request_id", f"{len(request.request_id)} characters", "max_request_id_chars", c.max_request_id_chars
            )
        self._check_prompt(request)
        if len(request.stop) > c.max_stop:
            raise limit_error("stop", f"{len(request.stop)} stop strings", "max_stop", c.max_stop)
        longest = max(map(len, request.stop), default=0)
        if longest > c.max_stop_chars:
            raise limit_error("stop", f"a stop string of {longest} characters", "max_stop_chars", c.max_stop_chars)
        if len(request.stop_token_ids) > c.max_stop:
            raise limit_error("stop_token_ids", f"{len(request.stop_token_ids)} ids", "max_stop", c.max_stop)
        self._check_ids("stop_token_ids", request.stop_token_ids)
        if len(request.logit_bias) > c.max_logit_bias:
            raise limit_error("logit_bias", f"{len(request.logit_bias)} token ids", "max_logit_bias", c.max_logit_bias)
        self._check_ids("logit_bias", request.logit_bias)
        if request.n > c.max_n:
            raise limit_error("n", f"{request.n} choices", "max_n", c.max_n)
        if request.logprobs is not None and request.logprobs > c.max_top_logprobs:
            raise limit_error("logprobs", f"{request.logprobs} top logprobs", "max_top_logprobs", c.max_top_logprobs)
        for name in ("temperature", "top_p"):  # the models' ranges refuse NaN too; say it plainly
            if not math.isfinite(getattr(request, name)):
                raise APIError(400, f"{name}: must be a finite number", param=name)
        if request.top_k > self.vocab_size:
            raise APIError(
                400, f"top_k: {request.top_k} is more than the vocabulary ({self.vocab_size} tokens)", param="top_k"
            )
        self._check_constraint(request)
        if request.max_tokens is not None and request.max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"max_tokens: {request.max_tokens} is more than max_model_len {self.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def check_tokens(self, param: str, ids: List[int]) -> None:
        """After tokenizing: the prompt (from request field `param`) fits the context window, its ids
        are in the vocabulary."""
        if len(ids) > self.max_model_len:  # refused here, before it costs a replica (or a router) anything
            raise APIError(
                400,
                f"{param}: {len(ids)} prompt tokens, more than max_model_len {self.max_model_len}",
                param=param,
                code="context_length_exceeded",
            )
        self._check_ids(param, ids)

    # ---- helpers ---------------------------------------------------------------------------------

    def _check_prompt(self, request: GenerateRequest) -> None:
        c, limit = self.config, self.max_prompt_chars
        if request.messages is not None:
            if len(request.messages) > c.max_messages:
                raise limit_error("messages", f"{len(request.messages)} messages", "max_messages", c.max_messages)
            chars = 0
            for i, m in enumerate(request.messages):
                if isinstance(m.content, list) and len(m.content) > c.max_messages:
                    raise limit_error(
                        f"messages.{i}.content", f"{len(m.content)} content parts", "max_messages", c.max_messages
                    )
                chars += len(m.text())
            if chars > limit:
                raise limit_error("messages", f"{chars} characters of content", "max_prompt_chars", limit)
            for i, m in enumerate(request.messages):
                _check_unicode(f"messages.{i}.content", m.text())
        elif isinstance(request.prompt, str):
            if len(request.prompt) > limit:
                raise limit_error("prompt", f"{len(request.prompt)} characters", "max_prompt_chars", limit)
            _check_unicode("prompt", request.prompt)
        elif request.prompt is not None and len(request.prompt) > self.max_model_len:
            raise APIError(
                400,
                f"prompt: {len(request.prompt)} token ids, more than max_model_len {self.max_model_len}",
                param="prompt",
                code="context_length_exceeded",
            )

    def _check_constraint(self, request: GenerateRequest) -> None:
        """Sizes of what the output must follow, before a replica spends time compiling it."""
        c = self.config
        spec, tools = request.structured_outputs, request.tools or []
        if len(tools) > c.max_tools:
            raise limit_error("tools", f"{len(tools)} tools", "max_tools", c.max_tools)
        schemas = [t.function.parameters for t in tools if t.function.parameters is not None]
        if spec is not None and spec.json_schema is not None:
            schemas.append(spec.json_schema)
        param = "structured_outputs" if spec is not None else "tools"
        size = sum(len(json.dumps(t.function.parameters)) for t in tools) + (len(spec.cache_key()) if spec else 0)
        if size > c.max_constraint_chars:
            raise limit_error(
                param, f"a constraint of {size} characters", "max_constraint_chars", c.max_constraint_chars
            )
        depth = max(map(_depth, schemas), default=0)
        if depth > c.max_schema_depth:
            raise limit_error(param, f"a JSON schema nested {depth} deep", "max_schema_depth", c.max_schema_depth)

    def _check_ids(self, param: str, ids) -> None:
        # As vLLM does: ids the tokenizer cannot produce are refused here, not left to the model.
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is out of the vocabulary [0, {self.vocab_size})", param=param)


def _depth(value) -> int:
    """Nesting depth of JSON data, without recursion (a hostile schema may be deeper than Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _check_unicode(param: str, text: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"); the tokenizer cannot encode them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400, f"{param}: not valid Unicode text ({e.reason} at position {e.start})", param=param
        ) from None


def body_limit(config: LimitsConfig, max_model_len: int) -> int:
    """The largest HTTP body: configured, or room for a full context window of text."""
    return config.max_body_bytes or max_model_len * config.bytes_per_token + BODY_OVERHEAD_BYTES


class BodySizeLimit:
    """ASGI middleware: a request body over the limit gets a 413 before the app reads or parses it.

    A declared Content-Length is checked before a byte is read; a chunked body is counted while it
    is read and refused as soon as it passes the limit. The app then gets the body in one message
    (it reads it all anyway to parse the JSON). Requests without a body pass straight through.
    """

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], Awaitable[int]]):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
        declared = headers.get(b"content-length")
        if scope["type"] != "http" or (declared is None and b"transfer-encoding" not in headers):
            return await self.app(scope, receive, send)
        if declared is not None and not declared.isdigit():
            return await _refuse(APIError(400, "invalid Content-Length header"), scope, receive, send)
        try:
            limit = await self.max_bytes()  # may ask a replica for the context window, once
        except APIError as e:
            return await _refuse(e, scope, receive, send)
        if declared is not None and int(declared) > limit:
            return await _refuse(_too_large(int(declared), limit), scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                return await _refuse(_too_large(size, limit, more), scope, receive, send)
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _too_large(size: int, limit: int, partial: bool = False) -> APIError:
    what = f"more than {size}" if partial else str(size)
    return APIError(
        413,
        f"request body of {what} bytes is larger than the limit ingress.limits.max_body_bytes = {limit} bytes",
        code="request_too_large",
    )


async def _refuse(e: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    metrics.count_error(e.status_code, e.type)
    # Connection: close, so the proxy drops the rest of an unread body instead of draining it.
    await JSONResponse(e.body(), e.status_code, {**e.headers(), "Connection": "close"})(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # http.disconnect: streaming responses watch for it
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
