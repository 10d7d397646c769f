"""One score per replica, in seconds: how long this request would take there.

    prefill ahead of it (what the replica reported queued + what this router sent since)
  + its own prompt minus what that replica already caches,
    at the prefill rate the replica's decode batch leaves (decode-first scheduling)
  + its decode, at the batch and context it joins (the decode load already there)

Step times come from a `StepTimeModel` (batcher.simulated: the same model simulated replicas run
on), so the three terms are in one unit and comparable. There is no fleet-wide gate between
"affinity" and "load": a hot prefix stops pinning its holder as soon as the holder's queue costs
more than recomputing the prefix elsewhere, and the prefix then spreads on its own.
Pure functions over plain data classes: unit-tested without Ray.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Reversible, Sequence

from batcher.simulated import StepTimeModel


@dataclass(frozen=True)
class EngineShape:
    """The replicas' engine budgets (every replica of a deployment runs the same EngineConfig)."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Report:
    """What a replica last reported (LLMServer.record_routing_stats), timestamped by the replica."""

    time_s: float
    waiting: int
    running: int
    queued_prefill_tokens: int
    context_tokens: int
    kv_blocks_free: int
    kv_blocks_total: int

    @classmethod
    def parse(cls, stats: Optional[dict]) -> Optional["Report"]:
        if not stats or "time_s" not in stats:
            return None
        return cls(**{f: stats.get(f, 0) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Routed:
    """One request this router sent to a replica and has not seen complete."""

    routed_at: float
    prompt_tokens: int
    uncached_tokens: int


@dataclass
class Load:
    queued_prefill_tokens: float
    batch: float  # sequences running or about to join the batch
    context_tokens: float
    kv_blocks_free: Optional[float]  # None: unknown


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int  # expected decode length


def estimate_load(report: Optional[Report], inflight: Reversible[Routed], now: float, max_age_s: float,
                  block_size: int, prefill_tokens_per_s: float) -> Optional[Load]:
    """The replica's report plus what this router sent after it (`inflight` in routing order), less
    the prefill the replica has done since (at its rate); None when the report is missing or older
    than `max_age_s` (unknown, which is not the same as idle)."""
    if report is None or now - report.time_s > max_age_s:
        return None
    queued, batch, context, kv_free = (report.queued_prefill_tokens, report.running + report.waiting,
                                       report.context_tokens, report.kv_blocks_free)
    for r in reversed(inflight):  # newest first, down to the first one the report already counts
        if r.routed_at <= report.time_s:
            break
        queued += r.uncached_tokens
        batch += 1
        context += r.prompt_tokens
        kv_free -= -(-r.uncached_tokens // block_size)
    return Load(max(0.0, queued - (now - report.time_s) * prefill_tokens_per_s), batch, context, kv_free)


def prefill_rate(step: StepTimeModel, shape: EngineShape) -> float:
    """Prompt tokens per second a replica prefills when its whole step budget goes to prefill."""
    return shape.max_num_batched_tokens / step.step_seconds(shape.max_num_batched_tokens, 0, 0)


def own_load(inflight: Sequence[Routed], now: float, prefill_tokens_per_s: float) -> Load:
    """What this router alone knows of a replica: its own in-flight requests, their prefill
    assumed done at the replica's rate since they were sent."""
    return Load(
        queued_prefill_tokens=sum(max(0.0, r.uncached_tokens - (now - r.routed_at) * prefill_tokens_per_s)
                                  for r in inflight),
        batch=len(inflight), context_tokens=sum(r.prompt_tokens for r in inflight), kv_blocks_free=None,
    )


def fill_unknown(loads: Dict[Hashable, Optional[Load]], own: Dict[Hashable, Load]) -> Dict[Hashable, Load]:
    """A replica without a fresh report is assumed at least as loaded as the fleet's average known
    replica (and as what this router itself sent it), never idle."""
    known = [v for v in loads.values() if v is not None]
    n = len(known)
    mean = Load(sum(v.queued_prefill_tokens for v in known) / n, sum(v.batch for v in known) / n,
                sum(v.context_tokens for v in known) / n, None) if n else Load(0, 0, 0, None)
    out = {}
    for r, v in loads.items():
        if v is None:
            mine = own[r]
            v = Load(max(mine.queued_prefill_tokens, mean.queued_prefill_tokens), max(mine.batch, mean.batch),
                     max(mine.context_tokens, mean.context_tokens), None)
        out[r] = v
    return out


def expected_seconds(step: StepTimeModel, shape: EngineShape, load: Load, uncached_tokens: int,
                     request: Request) -> float:
    """Expected time to the request's last token on a replica with `load`."""
    batch = load.batch
    prefill_per_step = max(1.0, shape.max_num_batched_tokens - min(batch, shape.max_num_seqs))
    prefill = load.queued_prefill_tokens + uncached_tokens
    first = math.ceil(prefill / prefill_per_step) * step.step_seconds(
        min(prefill, prefill_per_step), min(batch, shape.max_num_seqs), load.context_tokens)
    joined = min(batch + 1, shape.max_num_seqs)
    decode = request.output_tokens * step.step_seconds(0, joined, load.context_tokens + request.prompt_tokens)
    if batch >= shape.max_num_seqs:  # a full batch: wait for that many sequences to finish first
        first += (batch + 1 - shape.max_num_seqs) / shape.max_num_seqs * decode
    return first + decode


def kv_full(load: Load, uncached_tokens: int, block_size: int) -> bool:
    """No room for the request's prompt blocks (as far as the report says)."""
    return load.kv_blocks_free is not None and load.kv_blocks_free < -(-(uncached_tokens + 1) // block_size)


@dataclass
class Score:
    replica: Hashable
    seconds: float
    kv_full: bool
    over_bound: bool  # taking it would put the replica above `load_bound` x the fleet's mean
    cached_tokens: int


def score_replicas(step: StepTimeModel, shape: EngineShape, loads: Dict[Hashable, Load],
                   cached_tokens: Dict[Hashable, int], request: Request, load_bound: float) -> List[Score]:
    """Every replica's score, best first: replicas with room in their KV cache first, then those
    within the load bound, then by expected seconds; ties (an idle fleet) broken at random.

    The bound is consistent hashing's "bounded loads" (Mirrokni et al., 2018) applied to affinity: a
    replica may hold at most ceil(load_bound x (sequences in the fleet + 1) / replicas), so a hot
    prefix cannot pile its traffic on its holder even where the step-time model finds it cheap
    (batching many sequences costs little per step, but their tokens come slower)."""
    capacity = math.ceil(load_bound * (sum(v.batch for v in loads.values()) + 1) / max(1, len(loads)))
    scores = []
    for r, load in loads.items():
        cached = cached_tokens.get(r, 0)
        uncached = request.prompt_tokens - cached
        scores.append(Score(r, expected_seconds(step, shape, load, uncached, request),
                            kv_full(load, uncached, shape.block_size), load.batch + 1 > capacity, cached))
    scores.sort(key=lambda s: (s.kv_full, s.over_bound, s.seconds, random.random()))
    return scores
