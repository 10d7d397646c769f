"""Typed errors of the engine: callers map them to HTTP statuses."""

from __future__ import annotations

from typing import Optional, Tuple


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class RequestTooLongError(EngineError, ValueError):
    """The request can never fit: it names the limit it breaks."""

    def __init__(self, limit_name: str, needed: int, limit: int, detail: str = ""):
        self.limit_name, self.needed, self.limit = limit_name, needed, limit
        super().__init__(
            f"request needs {needed} tokens but {limit_name} is {limit}" + (f": {detail}" if detail else "")
        )


class InvalidRequestError(EngineError, ValueError):
    """Malformed input (empty prompt, token ids out of the vocabulary, duplicate request id, a
    constraint that does not compile). `param`: the request field at fault, when not the prompt."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class LoRANotFoundError(EngineError, LookupError):
    """A request names a LoRA adapter this engine neither holds nor can find."""


class EngineDeadError(EngineError, RuntimeError):
    """The step loop died; the replica must be replaced."""


class StepError(EngineError, RuntimeError):
    """One step's forward or sampling raised. The requests that step had scheduled failed (their KV
    blocks are freed); the rest of the engine is as it was and serves on. `request_ids`: those requests."""

    def __init__(self, message: str, request_ids: Tuple[str, ...] = ()):
        super().__init__(message)
        self.request_ids = tuple(request_ids)
