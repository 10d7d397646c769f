"""One score per replica, in seconds: how long this request would take there.

    prefill ahead of it (what the replica reported queued, corrected by what this router sent and
    saw complete since)
  + its own prompt minus what that replica already caches,
    at the prefill rate the replica's decode batch leaves (decode-first scheduling)
  + its decode, at the batch and context it joins (the decode load already there)

Step times are each replica's own, learned from what it measures (router.cost_model: its reports,
shrunk toward a preset), so the three terms are in one unit and comparable, and a cache hit is
worth what recomputing it costs on that hardware. There is no fleet-wide gate between "affinity"
and "load": a hot prefix stops pinning its holder as soon as the holder's queue costs more than
recomputing the prefix elsewhere, and the prefix then spreads on its own. The tail rule: the
affinity margin never lets a holder win whose expected first token comes later than another
replica's would, recomputation included (so affinity never queues a request behind more than
recomputing its prefix elsewhere would cost). In a busy fleet, a recomputation also costs the
requests queued behind it: the ranking adds that (score_replicas' `fleet_busy`).

Per replica the load is one row (`ReplicaLoad`), rebuilt only when its report or this router's requests
on it change; a decision scores the whole fleet at once over those rows with numpy.
Pure functions over plain data classes: unit-tested without Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from batcher.simulated import StepTimeModel
from router.cost_model import FleetStepTimes
from router.load_bound import bounded_load, free_batch

StepTimes = Union[StepTimeModel, FleetStepTimes]  # one model for every replica, or one each


@dataclass(frozen=True)
class EngineShape:
    """The replicas' engine budgets (every replica of a deployment runs the same EngineConfig)."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Report:
    """What a replica last reported (LLMServer.record_routing_stats), timestamped by the replica.
    `request_ids`: the requests it held then (waiting or running); None from a replica that does
    not list them (then "counted in the report" is judged by time). `loras`: the LoRA adapters it
    holds in memory -> their cache ids (batcher.block_hash.adapter_cache_id)."""

    time_s: float
    waiting: int
    running: int
    queued_prefill_tokens: int
    context_tokens: int
    kv_blocks_free: int
    kv_blocks_total: int
    request_ids: Optional[FrozenSet[str]] = None
    loras: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, stats: Optional[dict]) -> Optional["Report"]:
        if not stats or "time_s" not in stats:
            return None
        ids = stats.get("request_ids")
        fields = {f: stats.get(f, 0) for f in cls.__dataclass_fields__ if f not in ("request_ids", "loras")}
        return cls(**fields, request_ids=None if ids is None else frozenset(ids), loras=dict(stats.get("loras") or {}))


@dataclass(frozen=True)
class Routed:
    """One request this router sent to a replica (`completed_at` set once Serve said it ended)."""

    routed_at: float
    prompt_tokens: int
    uncached_tokens: int
    request_id: Optional[str] = None
    completed_at: Optional[float] = None


@dataclass
class ReplicaLoad:
    queued_prefill_tokens: float
    batch: float  # sequences running or about to join the batch
    context_tokens: float
    kv_blocks_free: Optional[float]  # None: unknown
    time_s: float = field(default=0.0)  # the report's time (how fresh the load is)
    queued_at: Optional[float] = None  # when queued_prefill_tokens was true (None: at time_s)

    @property
    def queued_since(self) -> float:
        return self.time_s if self.queued_at is None else self.queued_at


@dataclass(frozen=True)
class RoutingRequest:
    prompt_tokens: int
    output_tokens: int  # expected decode length


def counted_in(report: Report, r: Routed) -> bool:
    """Whether `report` counts request `r` as waiting or running. By id where the replica lists
    them: exact whatever the clocks and delays. Else by time: sent before the report, and (if it
    ended) ended after it."""
    if report.request_ids is not None and r.request_id is not None:
        return r.request_id in report.request_ids
    return r.routed_at <= report.time_s and (r.completed_at is None or r.completed_at > report.time_s)


def prefill_backlog(tokens: float, since: float, sends: Iterable[Routed], prefill_tokens_per_s) -> Tuple[float, float]:
    """A replica's prefill left just after the last of `sends`, and when that was: `tokens` queued at
    `since`, then each request's uncached tokens added, in the order sent, onto what the work done
    since the one before left (a FIFO queue: Lindley's recursion, never below empty). Decaying the
    sum from `since` instead counts the time a replica sat idle as work done: a prompt sent to a
    replica whose queue had run dry vanishes from its load within one report's age."""
    last = since
    for r in sorted(sends, key=lambda r: r.routed_at):
        if r.routed_at > last:
            tokens, last = max(0.0, tokens - (r.routed_at - last) * prefill_tokens_per_s), r.routed_at
        tokens += r.uncached_tokens
    return tokens, last


def replica_load(
    report: Optional[Report],
    inflight: Iterable[Routed],
    completed: Iterable[Routed],
    block_size: int,
    prefill_tokens_per_s: float,
) -> Optional[ReplicaLoad]:
    """The report corrected by this router's own knowledge: requests in flight it does not count
    yet are added (their prefill queued behind the report's, prefill_backlog); requests it counts
    that have completed since are taken out (and only those: a completion a later report already
    reflects is not subtracted twice). None without a report."""
    if report is None:
        return None
    batch, context, kv_free = report.running + report.waiting, report.context_tokens, report.kv_blocks_free
    sent = [r for r in inflight if not counted_in(report, r)]
    for r in sent:
        batch += 1
        context += r.prompt_tokens
        kv_free -= -(-r.uncached_tokens // block_size)
    for r in completed:
        if counted_in(report, r):
            batch -= 1
            context -= r.prompt_tokens
            kv_free += -(-r.prompt_tokens // block_size)
    queued, at = prefill_backlog(report.queued_prefill_tokens, report.time_s, sent, prefill_tokens_per_s)
    return ReplicaLoad(queued, max(0, batch), max(0, context), kv_free, report.time_s, at)


def prefill_rate(step: StepTimes, shape: EngineShape):
    """Prompt tokens per second a replica prefills when its whole step budget goes to prefill (an
    array, one per replica, from FleetStepTimes)."""
    return shape.max_num_batched_tokens / step.step_seconds(shape.max_num_batched_tokens, 0, 0)


def own_load(inflight: Sequence[Routed], now: float, prefill_tokens_per_s: float) -> ReplicaLoad:
    """What this router alone knows of a replica: its own in-flight requests, their prefill
    done in order at the replica's rate since they were sent."""
    queued, at = prefill_backlog(0.0, -math.inf, inflight, prefill_tokens_per_s)
    return ReplicaLoad(
        queued_prefill_tokens=max(0.0, queued - (now - at) * prefill_tokens_per_s) if inflight else 0.0,
        batch=len(inflight),
        context_tokens=sum(r.prompt_tokens for r in inflight),
        kv_blocks_free=None,
        time_s=now,
    )


@dataclass
class FleetLoads:
    """The fleet's loads as columns (one entry per candidate replica), as of one instant."""

    queued: np.ndarray
    batch: np.ndarray
    context: np.ndarray
    kv_free: np.ndarray  # NaN: unknown


def stale_rows(rows: np.ndarray, now: float, max_age_s: float) -> np.ndarray:
    """Which rows (time_s first) have no report fresher than `max_age_s`: unknown, never idle."""
    return now - rows[:, 0] > max_age_s


def load_row(load: ReplicaLoad) -> Tuple[float, ...]:
    """A load as one row of the numbers fleet_loads reads."""
    return (
        load.time_s,
        load.queued_since,
        load.queued_prefill_tokens,
        load.batch,
        load.context_tokens,
        math.nan if load.kv_blocks_free is None else load.kv_blocks_free,
    )


def fleet_loads(
    rows: np.ndarray, now: float, max_age_s: float, prefill_tokens_per_s, own: Callable[[int], ReplicaLoad]
) -> FleetLoads:
    """Columns from cached rows (load_row: time_s, queued since, queued, batch, context, kv_free;
    time_s = -inf: no report), the queued prefill decayed to `now`. A replica without a fresh report
    is assumed at least as loaded as the fleet's average known replica and as what this router sent
    it (`own(i)`), never idle."""
    t, since, queued, batch, context, kv_free = rows.T
    queued = np.maximum(0.0, queued - (now - since) * prefill_tokens_per_s)
    stale = stale_rows(rows, now, max_age_s)
    if stale.any():
        fresh = ~stale
        mean = [c[fresh].mean() if fresh.any() else 0.0 for c in (queued, batch, context)]
        queued, batch, context, kv_free = queued.copy(), batch.copy(), context.copy(), kv_free.copy()
        for i in np.flatnonzero(stale):
            mine = own(i)
            queued[i] = max(mine.queued_prefill_tokens, mean[0])
            batch[i] = max(mine.batch, mean[1])
            context[i] = max(mine.context_tokens, mean[2])
            kv_free[i] = math.nan
    return FleetLoads(queued, batch, context, kv_free)


def expected_seconds(
    step: StepTimes, shape: EngineShape, loads: FleetLoads, uncached_tokens: np.ndarray, request: RoutingRequest
) -> Tuple[np.ndarray, np.ndarray]:
    """Expected time to the request's first token and to its last, on each replica."""
    mns = shape.max_num_seqs
    in_batch = np.minimum(loads.batch, mns)
    prefill_per_step = np.maximum(1.0, shape.max_num_batched_tokens - in_batch)
    prefill = loads.queued + uncached_tokens
    first = np.ceil(prefill / prefill_per_step) * step.step_seconds(
        np.minimum(prefill, prefill_per_step), in_batch, loads.context
    )
    joined = np.minimum(loads.batch + 1, mns)
    decode = request.output_tokens * step.step_seconds(0, joined, loads.context + request.prompt_tokens)
    # A full batch: wait for that many sequences to finish first.
    first = first + np.where(loads.batch >= mns, (loads.batch + 1 - mns) / mns * decode, 0.0)
    return first, first + decode


@dataclass
class Score:
    replica: str
    seconds: float
    kv_full: bool
    over_bound: bool  # taking it would put the replica above `load_bound` x the fleet's mean
    cached_tokens: int


@dataclass
class Ranking(Sequence):
    """Every candidate's score, best first. Score objects are made only for the ranks read."""

    replicas: List[str]
    seconds: np.ndarray
    kv_full: np.ndarray
    over_bound: np.ndarray
    cached_tokens: np.ndarray
    order: np.ndarray  # candidate positions, best first

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[i] for i in range(*rank.indices(len(self)))]
        i = self.order[rank]
        return Score(
            self.replicas[i],
            float(self.seconds[i]),
            bool(self.kv_full[i]),
            bool(self.over_bound[i]),
            int(self.cached_tokens[i]),
        )


def score_replicas(
    step: StepTimes,
    shape: EngineShape,
    replicas: List[str],
    loads: FleetLoads,
    cached_tokens: np.ndarray,
    request: RoutingRequest,
    load_bound: float,
    affinity_margin: float,
    rng: np.random.Generator,
    fleet_sequences: Optional[float] = None,
    fleet_busy: float = 0.0,
    adapter_seconds: Optional[np.ndarray] = None,
    recent_routes: Optional[np.ndarray] = None,
) -> Ranking:
    """Every replica's score, best first: replicas with room in their KV cache first, then those
    within the load bound, then by expected seconds; ties (an idle fleet) go to the replica this
    router sent fewest of its `recent_routes`, then at random. Where every idle replica is equal, a
    new prompt goes where no other prompt was just sent, not by chance to one already holding one.

    The bound is consistent hashing's "bounded loads" (Mirrokni et al., 2018) applied to affinity: a
    replica may hold at most ceil(load_bound x mean) sequences, mean = (`fleet_sequences` + 1) /
    replicas, so a hot prefix cannot pile its traffic on its holder even where the step-time model
    finds it cheap (batching many sequences costs little per step, but their tokens come slower).
    Unlike a cache miss in consistent hashing, a move here recomputes the whole conversation, so the
    bound is loose where it would bite on counts alone: at least ceil(mean) + 1 (a mean of 1.5
    allows 3, not ceil(1.25 x 1.5) = 2), and `fleet_sequences` (default: the fleet's count now) is
    the recent peak the caller keeps, not a lull's count. Above the bound, a replica still takes the
    request while both say it is not loaded: its batch stays within its `free_batch` (sequences
    that barely slow its step), and its share of `recent_routes` (the requests the caller sent each
    replica within its window) stays within the same bound. The share is what spreads a hot prompt:
    its first turns arrive while the fleet holds a few sequences, and without it the prompt's holder
    takes a free batch of them, then their conversations fill its KV cache between turns.

    `affinity_margin` (>= 1): the replicas holding the longest cached prefix rank as if their
    expected seconds were that many times smaller, so a holder wins up to that factor of the best
    replica's wait (1: the expected seconds alone decide); but only a holder whose first token is
    expected no later than on any other replica (the tail rule: the margin forgives a slower
    decode, never a queue longer than recomputing the prefix elsewhere).

    `fleet_busy` (0-1, the share of time the fleet's engines spend stepping, as they measure it):
    recomputing a prefix is work every later request on that replica waits for, so a busy fleet
    ranks by the request's own seconds plus its prefill's cost to the others, busy / (1 - busy)
    times its prefill seconds (a queue's marginal cost, as in M/M/1). Idle, only its own seconds
    count; saturated, a recomputation costs up to 20 times itself, and sessions stay with their cache
    unless their holder is far worse off (as everyone gains when less is recomputed).

    `adapter_seconds`: what loading the request's LoRA adapter costs on each replica before its
    prefill (0 where it is resident; router.llm_router.adapter_costs), added to its first token."""
    uncached = request.prompt_tokens - cached_tokens
    first, seconds = expected_seconds(step, shape, loads, uncached, request)
    if adapter_seconds is not None:
        first, seconds = first + adapter_seconds, seconds + adapter_seconds
    kv_full = loads.kv_free < np.ceil((uncached + 1) / shape.block_size)  # NaN (unknown): never full
    total = loads.batch.sum() if fleet_sequences is None else fleet_sequences
    over_bound = loads.batch + 1 > bounded_load(total, len(replicas), load_bound)
    if recent_routes is not None:
        free = (loads.batch + 1 <= free_batch(step, request.prompt_tokens)) & (
            recent_routes + 1 <= bounded_load(recent_routes.sum(), len(replicas), load_bound)
        )
        over_bound &= ~free
    busy = min(max(fleet_busy, 0.0), 20 / 21)
    key = seconds + busy / (1 - busy) * uncached * step.prefill_token_s
    if affinity_margin != 1.0 and cached_tokens.max(initial=0) > 0:
        holders = cached_tokens == cached_tokens.max()
        # Against the others that could take it (room in their KV cache, within the bound).
        others_first = first[~holders & ~kv_full & ~over_bound].min(initial=math.inf)
        key = np.where(holders & (first <= others_first), key / affinity_margin, key)
    recent = recent_routes if recent_routes is not None else np.zeros(len(replicas))
    order = np.lexsort((rng.random(len(replicas)), recent, key, over_bound, kv_full))
    return Ranking(replicas, seconds, kv_full, over_bound, cached_tokens, order)


def adapter_costs(holds: np.ndarray, resident: np.ndarray, load_s: float) -> np.ndarray:
    """Seconds loading a request's LoRA adapter adds on each replica: none where it is held (`holds`),
    else `load_s`, plus up to half of it on replicas holding more adapters (`resident`: their counts),
    where loading one likely evicts another that its users will then reload."""
    return np.where(holds, 0.0, load_s * (1.0 + 0.5 * resident / (1.0 + resident.max(initial=0))))
