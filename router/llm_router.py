"""LLMRouter: a Ray Serve RequestRouter that sends each request where it will finish soonest.

It runs inside every caller of the LLM deployment (the ingress, so HTTP traffic and Python handle
callers alike). Per request it hashes the prompt's blocks exactly as the engine does (the ingress
has applied the chat template and tokenized: `GenerateRequest.prompt_token_ids`), looks up how much
of it each replica caches (router.index), estimates each replica's load from its last report
corrected by what this router sent and saw complete since (router.scoring), and ranks replicas by
expected seconds. No remote call
is made per request: reports arrive through Serve's routing stats, everything else is local.

    request_router_class: router:LLMRouter   (serve_config.yaml, under args.router)
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from batcher.block_manager import cacheable_block_hashes
from batcher.simulated import PRESETS
from router import feedback
from router.config import LLMRouterConfig
from router.index import PrefixIndex
from router.scoring import (EngineShape, Load, Ranking, Report, Request, Routed, fleet_loads, own_load,
                            prefill_rate, replica_load, score_replicas)

_TOP_RANKS = 3  # ranked one by one; the rest form one last group (Serve takes its least loaded)
_FORGET_AFTER_S = 3600.0  # a request still counted after this long was lost without a callback
_ANSWER_WAIT_S = 900.0  # a request's answer is expected within this (it ends the request)
_MAX_COMPLETED = 4096  # per replica: completions its latest report may still count
_NO_REPORT = (-math.inf, 0.0, 0.0, 0.0, math.nan)  # a load row that is never fresh


@dataclass
class _Prepared:
    request_id: Optional[str]
    hashes: List[int]
    request: Request


class LLMRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        cfg = LLMRouterConfig.model_validate(kwargs)
        self.config = cfg
        self.step_model = PRESETS[cfg.cost_model or "cpu-smollm2"].step
        self.shape = EngineShape(cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.prefill_tokens_per_s = prefill_rate(self.step_model, self.shape)
        self.index = PrefixIndex(cfg.max_blocks_per_replica)
        self._rng = np.random.default_rng()
        self._prepared: "OrderedDict[str, _Prepared]" = OrderedDict()  # by Serve's internal request id
        # Per replica (keyed by ReplicaID.unique_id): requests in flight, requests completed since
        # (while its report may still count them), its last report and the load row made of them.
        self._inflight: Dict[str, Dict[str, Routed]] = {}
        self._completed: Dict[str, Deque[Routed]] = {}
        self._reports: Dict[str, tuple] = {}  # (the stats dict Serve delivered, its Report)
        self._rows: Dict[str, tuple] = {}  # (time_s, queued, batch, context, kv_free); dropped on change
        # Internal request id -> (replica it is counted on, since when), oldest first.
        self._tracked: "OrderedDict[str, Tuple[str, float]]" = OrderedDict()
        # Our request id -> (replica, its prompt's block hashes): the answer's blocks chain on from them.
        self._awaiting_answer: "OrderedDict[str, Tuple[ReplicaID, List[int], float]]" = OrderedDict()
        self._mean_output_tokens: Optional[float] = None
        self._fleet_peaks: Deque[Tuple[float, float]] = deque()  # (time, fleet sequences), decreasing
        feedback.register(self)

    # ---- the decision ------------------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:  # Serve asks without a request when it only wants any replica
            return [candidate_replicas]
        if not hasattr(next(iter(pending_request.args), None), "prompt_token_ids"):
            # Not a generation (stats, model info): it costs nothing, and a caller polling every
            # replica must reach the busy ones too, so any replica at random.
            return [[r] for r in random.sample(candidate_replicas, len(candidate_replicas))]
        key = pending_request.metadata.internal_request_id
        prepared = self._prepare(pending_request)
        ranking = self.score(candidate_replicas, prepared)
        best = ranking[0]
        # Count the request on its first choice now: a burst is routed by concurrent tasks before
        # Serve confirms any of them (on_request_routed), and each must see the ones before it.
        self._track(key, best.replica, prepared, best.cached_tokens)
        # Its prefix too: the next requests of a burst that share it should follow it there, not
        # spread it while Serve confirms (on_request_routed corrects the rare other choice).
        self.index.insert(best.replica, prepared.hashes)
        ranked = [candidate_replicas[i] for i in ranking.order]
        return [[r] for r in ranked[:_TOP_RANKS]] + ([ranked[_TOP_RANKS:]] if len(ranked) > _TOP_RANKS else [])

    def score(self, candidates: Sequence[RunningReplica], prepared: _Prepared,
              now: Optional[float] = None) -> Ranking:
        now = time.time() if now is None else now
        cfg, bs = self.config, self.shape.block_size
        rids = [r.replica_id.unique_id for r in candidates]  # str keys: ReplicaID hashes in Python, 10x slower
        rows = np.array([self._row(rid, r.routing_stats) for rid, r in zip(rids, candidates)], dtype=float)
        loads = fleet_loads(rows, now, cfg.max_stats_age_s, self.prefill_tokens_per_s,
                            lambda i: own_load(list(self._inflight.get(rids[i], {}).values()), now,
                                               self.prefill_tokens_per_s))
        matched = self.index.matched_blocks(prepared.hashes)
        most = prepared.request.prompt_tokens - 1  # never the last token: the engine always computes it
        cached = np.minimum(np.fromiter((matched.get(rid, 0) for rid in rids), float, len(rids)) * bs, most)
        return score_replicas(self.step_model, self.shape, rids, loads, cached, prepared.request,
                              cfg.load_bound, cfg.affinity_margin, self._rng,
                              fleet_sequences=self._recent_peak(now, float(loads.batch.sum())))

    def _recent_peak(self, now: float, sequences: float) -> float:
        """The most sequences the fleet held within the last `load_window_s` (this one included): a
        deque of decreasing counts, so each decision costs O(1) amortized."""
        peaks = self._fleet_peaks
        while peaks and peaks[-1][1] <= sequences:
            peaks.pop()
        peaks.append((now, sequences))
        while peaks[0][0] < now - self.config.load_window_s:
            peaks.popleft()
        return peaks[0][1]

    def load(self, rid: str, stats: Optional[dict]) -> Optional[Load]:
        """Replica `rid`'s load as of its report `stats` (None: no report), this router's requests applied."""
        return replica_load(self._report(rid, stats), self._inflight.get(rid, {}).values(),
                            self._completed.get(rid, ()), self.shape.block_size)

    def _row(self, rid: str, stats: Optional[dict]) -> tuple:
        report = self._report(rid, stats)
        row = self._rows.get(rid)
        if row is None:
            load = self.load(rid, stats) if report is not None else None
            row = self._rows[rid] = _NO_REPORT if load is None else (
                load.time_s, load.queued_prefill_tokens, load.batch, load.context_tokens, load.kv_blocks_free)
        return row

    def _report(self, rid: str, stats: Optional[dict]) -> Optional[Report]:
        """Parsed once per report Serve delivers (a new dict each time), not once per decision."""
        cached = self._reports.get(rid)
        if cached is not None and cached[0] is stats:
            return cached[1]
        report = Report.parse(stats)
        if report is not None:
            self.index.set_capacity(rid, report.kv_blocks_total)
            # Completions before this report was taken are in it (and in every later one).
            done = self._completed.get(rid)
            while done and done[0].completed_at < report.time_s:
                done.popleft()
        self._reports[rid] = (stats, report)
        self._rows.pop(rid, None)
        return report

    def _prepare(self, pending_request: PendingRequest) -> _Prepared:
        """Hashes the request once, however often Serve asks to route it (it retries under backoff)."""
        key = pending_request.metadata.internal_request_id
        prepared = self._prepared.get(key)
        if prepared is None:
            prepared = self._prepared[key] = self.prepare(next(iter(pending_request.args), None))
            self._bound(self._prepared)
        return prepared

    def prepare(self, request) -> _Prepared:
        """What the decision needs from a GenerateRequest (anything else: no prefix, default length)."""
        ids = getattr(request, "prompt_token_ids", None) or []
        expected = self._mean_output_tokens or self.config.default_output_tokens
        max_tokens = getattr(request, "max_tokens", None)
        out = min(max_tokens, expected) if max_tokens else expected
        return _Prepared(getattr(request, "request_id", None), cacheable_block_hashes(ids, self.shape.block_size),
                         Request(prompt_tokens=max(1, len(ids)), output_tokens=max(1, round(out))))

    # ---- Serve's lifecycle hooks -------------------------------------------------------------------

    def _track(self, key: str, rid: str, prepared: _Prepared, cached: int) -> None:
        """Counts request `key` as in flight on replica `rid` (moving it if counted elsewhere)."""
        self._untrack(key)
        now = time.time()
        self._inflight.setdefault(rid, {})[key] = Routed(
            now, prepared.request.prompt_tokens, prepared.request.prompt_tokens - cached, prepared.request_id)
        self._tracked[key] = (rid, now)
        self._rows.pop(rid, None)
        # Oldest first: a request Serve never confirmed or completed (cancelled while queued) must
        # not weigh on its replica for ever.
        while self._tracked:
            old_key, (_, since) = next(iter(self._tracked.items()))
            if now - since < _FORGET_AFTER_S and len(self._tracked) <= self.config.max_tracked_requests:
                break
            self._untrack(old_key)

    def _untrack(self, key: str) -> Tuple[Optional[str], Optional[Routed]]:
        rid, _ = self._tracked.pop(key, (None, None))
        if rid is None:
            return None, None
        self._rows.pop(rid, None)
        return rid, self._inflight.get(rid, {}).pop(key, None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = pending_request.metadata.internal_request_id
        prepared = self._prepared.pop(key, None)
        if prepared is None:
            return
        rid = replica_id.unique_id
        if self._tracked.get(key, (None,))[0] != rid:  # Serve sent it to another choice than the first
            cached = min(self.index.matched_blocks(prepared.hashes).get(rid, 0) * self.shape.block_size,
                         prepared.request.prompt_tokens - 1)
            self._track(key, rid, prepared, cached)
            # That replica computes these blocks (choose_replicas put them on the first choice).
            self.index.insert(rid, prepared.hashes)
        if prepared.request_id:
            now = time.time()
            self._awaiting_answer[prepared.request_id] = (replica_id, prepared.hashes, now)
            self._bound(self._awaiting_answer)
            # Hashes are ~40 bytes a block: entries of requests that never report an answer (failed
            # ones) go after a while, not only at the count bound.
            while next(iter(self._awaiting_answer.values()))[2] < now - _ANSWER_WAIT_S:
                self._awaiting_answer.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """No longer in flight; but the replica's latest report may still count it (it was taken
        before the request ended), so it is kept as a completion until a later report arrives."""
        rid, routed = self._untrack(internal_request_id)
        if routed is not None:
            done = self._completed.setdefault(rid, deque(maxlen=_MAX_COMPLETED))
            done.append(replace(routed, completed_at=time.time()))

    def record_answer(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A finished answer: its blocks stay cached on the replica that computed it, and its length
        feeds the decode estimate of requests whose max_tokens is not binding. Runs on the router's
        loop (Serve may run routers in a thread of their own, apart from the caller's loop)."""
        loop = self._lazily_fetched_loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is not None and loop is not here and loop.is_running():
            loop.call_soon_threadsafe(self._record_answer, request_id, prompt_token_ids, output_token_ids)
        else:
            self._record_answer(request_id, prompt_token_ids, output_token_ids)

    def _record_answer(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        replica_id, prompt_hashes, _ = self._awaiting_answer.pop(request_id, (None, None, None))
        if replica_id is None:
            return
        m, n = self._mean_output_tokens, len(output_token_ids)
        self._mean_output_tokens = n if m is None else 0.95 * m + 0.05 * n
        if replica_id in self._replicas:
            # The engine's chain over prompt + answer, continued from the prompt's hashes.
            tokens = list(prompt_token_ids) + list(output_token_ids)
            self.index.insert(replica_id.unique_id,
                              cacheable_block_hashes(tokens, self.shape.block_size, known=prompt_hashes))

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        gone = set(self._inflight) | set(self.index.replicas())
        gone -= {rid.unique_id for rid in self._replica_id_set}
        self.index.remove_replicas(gone)
        for rid in gone:
            self._forget(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove_replicas([replica_id.unique_id])
        self._forget(replica_id.unique_id)

    def _forget(self, rid: str) -> None:
        for table in (self._inflight, self._completed, self._reports, self._rows):
            table.pop(rid, None)

    def _bound(self, table: OrderedDict) -> None:
        while len(table) > self.config.max_tracked_requests:
            table.popitem(last=False)
