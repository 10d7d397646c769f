"""OpenAI-style errors: one exception type that crosses Ray process boundaries, and the mapping
from whatever went wrong (engine, validation, Serve overload, dead replica) to status + body."""

from __future__ import annotations

from typing import Optional

import pydantic

from batcher.errors import EngineDeadError, InvalidRequestError, LoRANotFoundError, RequestTooLongError


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body. Raised by replicas to handle callers."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        retry_after_s: Optional[int] = None,
    ):
        super().__init__(status_code, message, type, param, code, retry_after_s)  # all args: pickles
        self.status_code, self.message, self.type = status_code, message, type
        self.param, self.code, self.retry_after_s = param, code, retry_after_s

    def __str__(self) -> str:
        return f"{self.status_code} {self.type}: {self.message}"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def validation_error(exc: pydantic.ValidationError | list, prefix: str = "") -> APIError:
    """400 naming the first offending field (from a pydantic error or FastAPI's error list)."""
    errors = exc.errors() if isinstance(exc, pydantic.ValidationError) else exc
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # FastAPI's: loc is ("body", position)
        return APIError(
            400,
            f"invalid JSON in the request body at position {first['loc'][-1]}: "
            f"{(first.get('ctx') or {}).get('error', first.get('msg'))}",
        )
    loc = [clip(str(p)) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else "request body: " if list(first.get("loc", ())) == ["body"] else ""
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's wrapping of our validators
    message = f"{prefix}{where}{msg}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param)


def engine_error(exc: Exception, prompt_param: str = "prompt") -> APIError:
    """Maps a batcher error to its APIError; anything unexpected becomes a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestTooLongError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, LoRANotFoundError):  # the replica looked for the adapter and found none
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param or prompt_param)
    if isinstance(exc, pydantic.ValidationError):
        return validation_error(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(
            503, f"engine unavailable: {exc}", type="service_unavailable_error", code="engine_dead", retry_after_s=1
        )
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error")


def overload_error(status_code: int, retry_after_s: int) -> APIError:
    kind = "rate_limit_error" if status_code == 429 else "service_unavailable_error"
    return APIError(
        status_code,
        "server overloaded: too many requests queued, retry later",
        type=kind,
        code="overloaded",
        retry_after_s=retry_after_s,
    )


def clip(text: str, limit: int = 64) -> str:
    """Client text echoed in an error, cut short: a 1 MB field name must not come back as 1 MB."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def model_not_found(name: Optional[str], served: str) -> APIError:
    return APIError(
        404,
        f"The model `{clip(str(name))}` does not exist. This server serves `{served}`.",
        param="model",
        code="model_not_found",
    )
