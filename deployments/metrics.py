"""Prometheus metrics of the application: defined here, updated by the LLM replica and the ingress.

They go out through Ray's metrics agent on every node (`ray start --metrics-export-port=...`), which
names them `ray_<name>`, adds `_total` to counters and `_bucket` / `_sum` / `_count` to histograms
(`exported_names()`). Every series carries `application` and `replica` (Serve's replica context; the
replica's unique id, as in the `X-Iterserve-Replica` header); requests add `finish_reason`, errors
`error_type` and `status_code`. Nothing per request id: one series per replica and label value.

The step loop pays nothing: the replica reads the clock at a request's first and last chunk, and
copies the engine's gauges and counters (plain data in batcher.EngineStats) every `REFRESH_S`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from ray.util.metrics import Counter, Gauge, Histogram

from batcher.outputs import EngineStats

REFRESH_S = 1.0  # how often the replica copies engine stats into gauges and counters
LABELS = ("application", "replica")

# Seconds. Wide enough for a CPU replica (TTFT of seconds under load) and fine enough at the low end
# for a GPU one (TPOT of a few ms).
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)
E2E_BUCKETS = (
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    labels: Tuple[str, ...] = ()  # beyond LABELS
    buckets: Tuple[float, ...] = ()
    engine_field: Optional[str] = None  # copied from EngineStats by the refresh (else observed)

    def exported(self) -> Tuple[str, ...]:
        """The series names Prometheus scrapes for this metric."""
        name = f"ray_{self.name}"
        if self.kind == "counter":
            return (f"{name}_total",)
        if self.kind == "histogram":
            return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
        return (name,)


SPECS = (
    MetricSpec(
        "iterserve_time_to_first_token_seconds",
        "histogram",
        "Seconds from the LLM replica taking a request to its first token",
        buckets=TTFT_BUCKETS,
    ),
    MetricSpec(
        "iterserve_time_per_output_token_seconds",
        "histogram",
        "Seconds per output token after the first, per finished request",
        buckets=TPOT_BUCKETS,
    ),
    MetricSpec(
        "iterserve_e2e_request_latency_seconds",
        "histogram",
        "Seconds from the LLM replica taking a request to its last token (finished requests)",
        buckets=E2E_BUCKETS,
    ),
    MetricSpec("iterserve_num_requests_waiting", "gauge", "Requests queued in the engine", engine_field="waiting"),
    MetricSpec("iterserve_num_requests_running", "gauge", "Requests in the running batch", engine_field="running"),
    MetricSpec("iterserve_kv_cache_usage_ratio", "gauge", "Share of KV blocks in use (0..1)", engine_field="kv_usage"),
    MetricSpec("iterserve_kv_blocks_free", "gauge", "Free KV blocks", engine_field="kv_blocks_free"),
    MetricSpec(
        "iterserve_preemptions",
        "counter",
        "Sequences preempted (recompute) for lack of KV blocks",
        engine_field="preemptions",
    ),
    MetricSpec(
        "iterserve_prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache",
        engine_field="prefix_cache_hits",
    ),
    MetricSpec(
        "iterserve_prefix_cache_query_tokens",
        "counter",
        "Prompt tokens looked up in the prefix cache",
        engine_field="prefix_cache_queries",
    ),
    MetricSpec(
        "iterserve_prompt_tokens", "counter", "Prompt tokens of requests the engine took", engine_field="prompt_tokens"
    ),
    MetricSpec("iterserve_generation_tokens", "counter", "Output tokens generated", engine_field="generated_tokens"),
    MetricSpec(
        "iterserve_requests",
        "counter",
        "Requests ended at the LLM replica, by finish reason",
        labels=("finish_reason",),
    ),
    MetricSpec(
        "iterserve_errors",
        "counter",
        "Error answers of the HTTP ingress, by OpenAI error type",
        labels=("error_type", "status_code"),
    ),
)
SPEC = {s.name: s for s in SPECS}

# Per LoRA adapter (label `adapter`), from EngineStats.lora_counters: exported by replicas that serve
# adapters only, so apart from SPECS (whose series every replica exports).
LORA_COUNTERS = {
    "requests": "Requests that used the adapter",
    "prompt_tokens": "Prompt tokens of its requests",
    "generated_tokens": "Output tokens generated with it",
    "loads": "Times a replica read it into memory",
    "evictions": "Times a replica dropped it from memory (LRU)",
}
LORA_SPECS = tuple(
    MetricSpec(f"iterserve_lora_{key}", "counter", f"LoRA adapters: {text}", labels=("adapter",))
    for key, text in LORA_COUNTERS.items()
)


def exported_names() -> set:
    return {n for s in SPECS for n in s.exported()}


def lora_exported_names() -> set:
    return {n for s in LORA_SPECS for n in s.exported()}


def replica_tags() -> Optional[Dict[str, str]]:
    """Application and replica of the calling Serve replica; None outside Serve."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        ctx = serve.get_replica_context()
    except RayServeException:
        return None
    return {"application": ctx.app_name, "replica": ctx.replica_id.unique_id}


def _make(spec: MetricSpec, tags: Dict[str, str]):
    keys = LABELS + spec.labels
    if spec.kind == "histogram":
        metric = Histogram(spec.name, spec.description, boundaries=list(spec.buckets), tag_keys=keys)
    else:
        metric = (Counter if spec.kind == "counter" else Gauge)(spec.name, spec.description, tag_keys=keys)
    return metric.set_default_tags(tags)


class RequestTimer:
    """One request's clock at the replica: started when it arrives, read at its first token."""

    __slots__ = ("start", "first_token")

    def __init__(self):
        self.start = time.perf_counter()
        self.first_token: Optional[float] = None

    def saw(self, num_new_tokens: int) -> None:
        if self.first_token is None and num_new_tokens:
            self.first_token = time.perf_counter()

    @property
    def ttft_s(self) -> Optional[float]:
        """Seconds from arrival to the first token (None before it): the TTFT metric and the answer's
        replica_ttft_s."""
        return None if self.first_token is None else self.first_token - self.start


class ReplicaMetrics:
    """The LLM replica's metrics: per-request timings observed, engine stats copied periodically."""

    def __init__(self, tags: Dict[str, str]):
        self._m = {s.name: _make(s, tags) for s in SPECS if s.name != "iterserve_errors"}
        self._engine_specs = [s for s in SPECS if s.engine_field]
        self._copied: Dict[str, float] = {s.name: 0 for s in self._engine_specs if s.kind == "counter"}
        self._lora = {key: _make(spec, tags) for key, spec in zip(LORA_COUNTERS, LORA_SPECS)}
        self._lora_copied: Dict[Tuple[str, str], int] = {}  # (adapter, counter) -> value copied

    def finish(self, timer: RequestTimer, finish_reason: str, num_output_tokens: int) -> None:
        """Records a request that ended: TTFT if it got a token; e2e and TPOT unless aborted."""
        now = time.perf_counter()
        m = self._m
        if timer.first_token is not None:
            m["iterserve_time_to_first_token_seconds"].observe(timer.ttft_s)
            if finish_reason != "abort":
                m["iterserve_e2e_request_latency_seconds"].observe(now - timer.start)
                if num_output_tokens > 1:
                    m["iterserve_time_per_output_token_seconds"].observe(
                        (now - timer.first_token) / (num_output_tokens - 1)
                    )
        m["iterserve_requests"].inc(tags={"finish_reason": finish_reason})

    def refresh(self, stats: EngineStats) -> None:
        """Gauges take the engine's values; counters advance by what the engine counted since."""
        for spec in self._engine_specs:
            value = getattr(stats, spec.engine_field)
            if spec.kind == "gauge":
                self._m[spec.name].set(value)
            elif value > self._copied[spec.name]:
                self._m[spec.name].inc(value - self._copied[spec.name])
                self._copied[spec.name] = value
        for adapter, counts in stats.lora_counters.items():
            for key, counter in self._lora.items():
                value, done = counts.get(key, 0), self._lora_copied.get((adapter, key), 0)
                if value > done:
                    counter.inc(value - done, tags={"adapter": adapter})
                    self._lora_copied[adapter, key] = value

    async def refresh_forever(self, stats: Callable[[], EngineStats], period_s: float = REFRESH_S) -> None:
        """The replica's background task (cancelled with the replica's event loop)."""
        while True:
            try:
                self.refresh(stats())
            except Exception:  # a metrics hiccup must never take the replica down
                logging.getLogger("ray.serve").exception("iterserve metrics refresh failed")
            await asyncio.sleep(period_s)


@functools.lru_cache(maxsize=None)
def _errors_counter() -> Optional[Counter]:
    tags = replica_tags()
    return _make(SPEC["iterserve_errors"], tags) if tags is not None else None


def count_error(status_code: int, error_type: str) -> None:
    """One error answer of the ingress (no-op outside a Serve replica)."""
    counter = _errors_counter()
    if counter is not None:
        counter.inc(tags={"error_type": error_type, "status_code": str(status_code)})
