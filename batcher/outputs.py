"""Plain data classes the engine hands to its callers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: Dict[int, float] = field(default_factory=dict)  # token id -> logprob, best first


@dataclass
class Completion:
    """The whole result of one request."""

    request_id: str
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: str
    finish_reason: Optional[str]  # "stop" | "length" | "abort"
    logprobs: Optional[List[TokenLogprob]] = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    index: int = 0  # which of the request's n choices


@dataclass
class StreamDelta:
    """What one choice of a request gained since the previous delta; finish_reason is set on its last."""

    request_id: str
    token_ids: List[int]
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[List[TokenLogprob]] = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    index: int = 0  # which of the request's n choices (SamplingParams.n)


@dataclass
class EngineStats:
    waiting: int = 0
    running: int = 0
    preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0  # share of KV blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    steps: int = 0
    tokens_computed: int = 0  # tokens whose K/V a step computed: prefill, recompute and decode
    prompt_tokens: int = 0  # prompt tokens of every request added (once per request, not per recompute)
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0  # ended by a failed step (batcher.errors.StepError)
    ended_output_tokens: int = 0  # tokens the ended requests (finished, aborted, failed) generated, all choices
    failed_steps: int = 0  # steps whose forward or sampling raised
    forward_seconds: float = 0.0  # wall time inside the model forward (ModelRunner.execute)
    step_seconds: float = 0.0  # wall time of whole steps
    kv_slot_use_sum: float = 0.0  # per step: tokens held / slots allocated, summed (mean = /steps)
    seconds_since_last_step: float = 0.0
    loop_alive: bool = True
    queued_prefill_tokens: int = 0  # prompt tokens waiting or running that are not computed yet
    context_tokens: int = 0  # tokens held by running sequences (what their decode steps attend to)
    simulation: str = ""  # the step-time preset of a simulated replica ("" for a real model)
    resident_loras: Dict[str, str] = field(default_factory=dict)  # adapters in memory -> their cache ids
    # adapter -> {"requests", "prompt_tokens", "generated_tokens", "loads", "evictions"}, cumulative
    lora_counters: Dict[str, Dict[str, int]] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each round: callers on other threads read this,
    never the scheduler's queues, which the engine thread mutates while they would walk them."""

    stats: EngineStats
    held_request_ids: Tuple[str, ...]  # waiting or running (request routers match them against their own)
    last_step_time: float  # time.monotonic() of the last step


def merge_deltas(first: StreamDelta, later: StreamDelta) -> StreamDelta:
    """One delta covering both, of the same choice (used to coalesce stream chunks)."""
    assert first.index == later.index, "deltas of different choices do not merge"
    logprobs = None
    if first.logprobs is not None or later.logprobs is not None:
        logprobs = (first.logprobs or []) + (later.logprobs or [])
    return StreamDelta(
        request_id=first.request_id,
        token_ids=first.token_ids + later.token_ids,
        text=first.text + later.text,
        finish_reason=later.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=later.num_prompt_tokens,
        num_generated_tokens=later.num_generated_tokens,
        num_cached_tokens=later.num_cached_tokens,
        index=later.index,
    )


def merge_by_choice(deltas: List[StreamDelta]) -> List[StreamDelta]:
    """One delta per choice, in the order the choices first appear."""
    merged: Dict[int, StreamDelta] = {}
    for d in deltas:
        merged[d.index] = merge_deltas(merged[d.index], d) if d.index in merged else d
    return list(merged.values())


def completions_by_choice(prompt_token_ids: List[int], deltas: List[StreamDelta]) -> List[Completion]:
    """A request's deltas (its choices' interleaved) -> one Completion per choice, by index."""
    merged = sorted(merge_by_choice(deltas), key=lambda d: d.index)
    return [completion_from_deltas(prompt_token_ids, [d]) for d in merged]


def completion_from_deltas(prompt_token_ids: List[int], deltas: List[StreamDelta]) -> Completion:
    merged = deltas[0]
    for d in deltas[1:]:
        merged = merge_deltas(merged, d)
    return Completion(
        request_id=merged.request_id,
        prompt_token_ids=list(prompt_token_ids),
        token_ids=merged.token_ids,
        text=merged.text,
        finish_reason=merged.finish_reason,
        logprobs=merged.logprobs,
        num_cached_tokens=merged.num_cached_tokens,
        index=merged.index,
    )
