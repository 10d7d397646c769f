"""Typed errors of the engine: callers map them to HTTP statuses."""
from __future__ import annotations


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
    """Malformed input (empty prompt, token ids out of the vocabulary, duplicate request id)."""


class EngineDeadError(EngineError, RuntimeError):
    """The step loop died; the replica must be replaced."""
