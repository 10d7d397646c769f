"""One structured log line per HTTP completion request, written by the ingress when it ends.

The line is a JSON object on the "ray.serve" logger, so it lands in the ingress replica's Serve log
(`<ray logs>/serve/replica_<app>_OpenAIIngress_<id>.log`): request id, stream or not, HTTP status,
error type, finish reason, token counts, TTFT and end-to-end seconds, the seconds to prepare the
prompt and the LLM replica's own TTFT, the replica that served it.
Never prompt or output text, never headers (API keys).
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Optional

from deployments.protocol import GenerateChunk, GenerateResponse

EVENT = "iterserve_request"
logger = logging.getLogger("ray.serve")
_current: ContextVar[Optional["RequestLogEntry"]] = ContextVar("iterserve_request_record", default=None)


@dataclass
class RequestLogEntry:
    request_id: str
    stream: bool
    start: float = field(default_factory=time.perf_counter)
    prepare_s: Optional[float] = None  # until the prompt was templated, tokenized and checked
    ttft_s: Optional[float] = None  # streams only: until the first chunk left the ingress
    replica_ttft_s: Optional[float] = None  # the LLM replica's own, receipt to first token
    from_replica_s: Optional[float] = None  # streams only: the first chunk's way from the replica (wall clocks)
    written: bool = False

    def prepared(self) -> None:
        self.prepare_s = time.perf_counter() - self.start

    def first_token(self, replica_ttft_s: Optional[float], replica_sent_at: Optional[float] = None) -> None:
        self.ttft_s, self.replica_ttft_s = time.perf_counter() - self.start, replica_ttft_s
        if replica_sent_at is not None:  # two processes' wall clocks: one machine's, or a cluster's synced ones
            self.from_replica_s = time.time() - replica_sent_at

    def server_timing(self) -> str:
        """The Server-Timing header (ms): where a request's first token went. `prepare` (template,
        tokens, limits), `replica-ttft` (the LLM replica's queue and prefill), `ttft` (the ingress's
        whole, streams only): ttft - prepare - replica-ttft is routing and Serve's hops, of which
        `from-replica` (streams) is the first chunk's way back and the rest the request's way there."""
        parts = [
            ("prepare", self.prepare_s),
            ("replica-ttft", self.replica_ttft_s),
            ("ttft", self.ttft_s),
            ("from-replica", self.from_replica_s),
        ]
        return ", ".join(f"{name};dur={s * 1000:.1f}" for name, s in parts if s is not None)

    def write(
        self,
        status_code: int,
        out: "GenerateChunk | GenerateResponse | None" = None,
        error_type: Optional[str] = None,
        finish_reason: Optional[str] = None,
    ) -> None:
        """Logs the line once (later calls do nothing). `out`: the final or last seen output."""
        if self.written:
            return
        self.written = True
        if out is not None and out.replica_ttft_s is not None:  # a whole answer's (a stream's: first_token)
            self.replica_ttft_s = out.replica_ttft_s
        line = {
            "event": EVENT,
            "request_id": self.request_id,
            "stream": self.stream,
            "status_code": status_code,
            "error_type": error_type,
            "finish_reason": finish_reason or (out.finish_reason if out else None),
            "prompt_tokens": out.prompt_tokens if out else None,
            "output_tokens": out.completion_tokens if out else None,
            "cached_tokens": out.cached_tokens if out else None,
            "ttft_s": _round(self.ttft_s),
            "e2e_s": _round(time.perf_counter() - self.start),
            "prepare_s": _round(self.prepare_s),
            "replica_ttft_s": _round(self.replica_ttft_s),
            "from_replica_s": _round(self.from_replica_s),
            "replica_id": out.replica_id if out else None,
        }
        logger.info(json.dumps(line, separators=(",", ":")))


def begin(request_id: str, stream: bool) -> RequestLogEntry:
    """Starts the record of the current HTTP request (error handlers find it through a context var)."""
    record = RequestLogEntry(request_id, stream)
    _current.set(record)
    return record


def failed(status_code: int, error_type: str) -> None:
    """Logs the current request as failed, if one was begun and not logged yet."""
    record = _current.get()
    if record is not None:
        record.write(status_code, error_type=error_type)


def _round(seconds: Optional[float]) -> Optional[float]:
    return round(seconds, 4) if seconds is not None else None
