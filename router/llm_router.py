"""LLMRouter: a Ray Serve RequestRouter that sends each request where it will finish soonest.

It runs inside every caller of the LLM deployment (the ingress, so HTTP traffic and Python handle
callers alike). Per request it hashes the prompt's blocks exactly as the engine does (the ingress
has applied the chat template and tokenized: `PreparedRequest.prompt_token_ids`), looks up how much
of it each replica caches (router.index), estimates each replica's load from its last report
corrected by what this router sent and saw complete since (router.scoring), turns tokens into
seconds with the step times each replica measured (router.cost_model), and ranks replicas by
expected seconds. No remote call is made per request: reports arrive through Serve's routing stats,
everything else is local. What it knows of each request lives in one RequestLedger (router.ledger);
this class is the decision and Serve's hooks feeding the ledger.

    request_router_class: router:LLMRouter   (serve_config.yaml, under args.router)
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from batcher.block_hash import cacheable_block_hashes, root_hash
from batcher.simulated import PRESETS
from router.config import LLMRouterConfig
from router.cost_model import FleetStepTimes, coefficients, learned_step
from router.eviction_feed import EvictionFeed
from router.index import PrefixIndex
from router.index_sync import IndexSync
from router.ledger import HashedRequest, RequestLedger
from router.load_bound import LoadWindow
from router.scoring import (
    EngineShape,
    Ranking,
    ReplicaLoad,
    Report,
    Routed,
    RoutingRequest,
    adapter_costs,
    fleet_loads,
    load_row,
    own_load,
    prefill_rate,
    replica_load,
    score_replicas,
    stale_rows,
)

_TOP_RANKS = 3  # ranked one by one; the rest form one last group (Serve takes its least loaded)
_NO_LOAD = (-math.inf, -math.inf, 0.0, 0.0, 0.0, math.nan)  # a load row (scoring.load_row) that is never fresh


class LLMRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        cfg = LLMRouterConfig.model_validate(kwargs)
        self.config = cfg
        self.step_model = PRESETS[cfg.cost_model or "cpu-smollm2"].step  # the prior of the learned ones
        self._prior = coefficients(self.step_model)
        self.shape = EngineShape(cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.index = PrefixIndex(cfg.max_blocks_per_replica, cfg.index_stride_blocks)
        self.ledger = RequestLedger(self.index, cfg.max_tracked_requests)
        self.evictions = EvictionFeed(self.index)  # what replicas report they evicted leaves the index
        self._root = root_hash(cfg.model)  # requests without a cache salt (most) share it
        self._rng = np.random.default_rng()
        self._reports: Dict[str, tuple] = {}  # replica -> (the stats dict Serve delivered, its Report)
        self._rows: Dict[str, tuple] = {}  # replica -> (stats dict, ledger version, row, step coefficients)
        self._mean_output_tokens: Optional[float] = None
        self.window = LoadWindow(cfg.load_window_s)  # the load bound's recent peak and this router's shares
        self._alive: set = set()  # the replicas Serve last gave this router
        self._lora_ids: Dict[str, str] = {}  # LoRA adapter -> the cache id replicas report for it
        self._adapter_sent: Dict[str, Dict[str, float]] = {}  # adapter -> replica -> last sent there
        # The loop Serve routes on (seen by choose_replicas): answers reported from other threads are
        # applied there. Serve's own reference (RequestRouter._event_loop) is private.
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        # What this router learns of the caches, shared with the deployment's other routers (ingress
        # replicas, handle callers: each routes with its own) and theirs taken (router.index_exchange).
        # Entries carry the blocks the index keeps, so only routers keeping the same ones share.
        deployment = getattr(self, "_deployment_id", None)
        self.sync = IndexSync(
            cfg.share_index_s,
            f"{getattr(deployment, 'app_name', '')}/{getattr(deployment, 'name', '')}/stride{self.index.stride}",
            self.index.kept_keys,
        )

    # ---- the decision ------------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:  # Serve asks without a request when it only wants any replica
            return [candidate_replicas]
        if not hasattr(next(iter(pending_request.args), None), "prompt_token_ids"):
            # Not a generation (stats, model info): it costs nothing, and a caller polling every
            # replica must reach the busy ones too, so any replica at random.
            return [[r] for r in random.sample(candidate_replicas, len(candidate_replicas))]
        self._loop = asyncio.get_running_loop()
        self.sync.start(self._learned_elsewhere)
        key = pending_request.metadata.internal_request_id
        # Serve asks again for the same request (backoff, a rejection): hashed once, counted once.
        taken_back = self.ledger.take_back(key)
        request = taken_back or self.prepare(
            pending_request.args[0], getattr(pending_request.metadata, "multiplexed_model_id", None)
        )
        ranking = self.score(candidate_replicas, request)
        best = ranking[0]
        if taken_back is None:
            self.window.routed(time.time(), best.replica)
        self._sent_adapter(request, best.replica)
        # Counted on its first choice, its prefix claimed there, from now on: a burst is routed by
        # concurrent tasks before Serve confirms any (on_request_routed), and each must see the ones
        # before it. The claim becomes cached blocks only where Serve confirms the request.
        self.ledger.chosen(key, best.replica, request, best.cached_tokens, time.time())
        ranked = [candidate_replicas[i] for i in ranking.order]
        return [[r] for r in ranked[:_TOP_RANKS]] + ([ranked[_TOP_RANKS:]] if len(ranked) > _TOP_RANKS else [])

    def prepare(self, request, multiplexed_model_id: Optional[str] = None) -> HashedRequest:
        """What the decision needs of the ingress's PreparedRequest: `prompt_token_ids`, `max_tokens`,
        `request_id`, `cache_salt`, `lora_name`, read by duck typing (a call without them routes as no
        prefix, the default length, the adapter Serve's multiplexed model id names). Hashed from the
        replicas' root: the engine's model, the request's salt and its adapter's cache id (as replicas
        report it; the name until one does: a hint either way)."""
        ids = getattr(request, "prompt_token_ids", None) or []
        salt = getattr(request, "cache_salt", None)
        adapter = getattr(request, "lora_name", None) or multiplexed_model_id or None
        if adapter is not None:
            root = root_hash(self.config.model, salt, adapter=self._lora_ids.get(adapter, adapter))
        else:
            root = self._root if salt is None else root_hash(self.config.model, salt)
        expected = self._mean_output_tokens or self.config.default_output_tokens
        max_tokens = getattr(request, "max_tokens", None)
        out = min(max_tokens, expected) if max_tokens else expected
        return HashedRequest(
            getattr(request, "request_id", None),
            root,
            cacheable_block_hashes(ids, self.shape.block_size, root),
            RoutingRequest(prompt_tokens=max(1, len(ids)), output_tokens=max(1, round(out))),
            adapter,
        )

    def score(
        self, candidates: Sequence[RunningReplica], request: HashedRequest, now: Optional[float] = None
    ) -> Ranking:
        now = time.time() if now is None else now
        cfg = self.config
        rids = [r.replica_id.unique_id for r in candidates]  # str keys: ReplicaID hashes in Python, 10x slower
        rows = np.array([self._row(rid, r.routing_stats) for rid, r in zip(rids, candidates)], dtype=float)
        load_rows, step_rows, busy = rows[:, :6], rows[:, 6:10], rows[:, 10]
        # Each replica's step times as it measured them; a stale report's are unknown: the prior.
        stale = stale_rows(load_rows, now, cfg.max_stats_age_s)
        step_rows[stale] = self._prior
        fresh_busy = busy[~stale & ~np.isnan(busy)]
        steps = FleetStepTimes.of(step_rows)
        rates = prefill_rate(steps, self.shape)
        loads = fleet_loads(
            load_rows,
            now,
            cfg.max_stats_age_s,
            rates,
            lambda i: own_load(list(self.ledger.inflight(rids[i])), now, rates[i]),
        )
        matched = self.index.matched_blocks(request.hashes)
        cached = np.fromiter((self._cached_tokens(request, matched.get(rid, 0)) for rid in rids), float, len(rids))
        return score_replicas(
            steps,
            self.shape,
            rids,
            loads,
            cached,
            request.sizes,
            cfg.load_bound,
            cfg.affinity_margin,
            self._rng,
            fleet_sequences=self.window.peak(now, float(loads.batch.sum())),
            recent_routes=self.window.recent_routes(now, rids),
            fleet_busy=float(fresh_busy.mean()) if len(fresh_busy) else 0.0,
            adapter_seconds=self._adapter_seconds(request.adapter, candidates, rids, now),
        )

    def _adapter_seconds(
        self, adapter: Optional[str], candidates: Sequence[RunningReplica], rids: List[str], now: float
    ) -> Optional[np.ndarray]:
        """The adapter first: replicas holding it (their reports, Serve's multiplexed model ids, or this
        router sent it there within a report's age) load nothing; the others pay its load."""
        if adapter is None:
            return None
        sent = self._adapter_sent.get(adapter, {})
        holds, resident = np.zeros(len(rids), bool), np.zeros(len(rids))
        for i, (rid, r) in enumerate(zip(rids, candidates)):
            report = (self._reports.get(rid) or (None, None))[1]
            loras = report.loras if report is not None else {}
            resident[i] = len(loras)
            holds[i] = (
                adapter in loras
                or adapter in getattr(r, "multiplexed_model_ids", ())
                or now - sent.get(rid, -math.inf) <= self.config.max_stats_age_s
            )
        return adapter_costs(holds, resident, self.config.adapter_load_s)

    def _sent_adapter(self, request: HashedRequest, rid: str) -> None:
        if request.adapter is not None:
            self._adapter_sent.setdefault(request.adapter, {})[rid] = time.time()

    def _cached_tokens(self, request: HashedRequest, matched_blocks: int) -> int:
        # Never the last token: the engine always computes it.
        return min(matched_blocks * self.shape.block_size, request.sizes.prompt_tokens - 1)

    def load(
        self, rid: str, stats: Optional[dict], prefill_tokens_per_s: Optional[float] = None
    ) -> Optional[ReplicaLoad]:
        """Replica `rid`'s load as of its report `stats` (None: no report), this router's requests applied;
        its prefill rate, unless given, from the step times the report implies."""
        if prefill_tokens_per_s is None:
            prefill_tokens_per_s = float(prefill_rate(self.step_times(stats), self.shape))
        return replica_load(
            self._report(rid, stats),
            self.ledger.inflight(rid),
            self.ledger.completed(rid),
            self.shape.block_size,
            prefill_tokens_per_s,
        )

    def step_times(self, stats: Optional[dict]):
        """The step-time model a replica's report `stats` implies: its measurements (`step_fit`)
        shrunk toward the prior (router.cost_model); the prior without them, or if
        `learn_step_times` is off."""
        if not self.config.learn_step_times or not stats:
            return self.step_model
        return learned_step(self.step_model, stats.get("step_fit"))

    def _row(self, rid: str, stats: Optional[dict]) -> tuple:
        """The load row, the replica's step-time coefficients and its busy share (NaN: unknown),
        rebuilt only when Serve delivers a new report or the ledger's requests on the replica change."""
        report = self._report(rid, stats)
        cached = self._rows.get(rid)
        version = self.ledger.version(rid)
        if cached is not None and cached[0] is stats and cached[1] == version:
            return cached[2]
        steps = (
            cached[3]
            if cached is not None and cached[0] is stats
            else (coefficients(self.step_times(stats)) + (((stats or {}).get("step_fit") or {}).get("busy", math.nan),))
        )
        load = (
            None
            if report is None
            else self.load(rid, stats, float(prefill_rate(FleetStepTimes.of([steps[:4]]), self.shape)[0]))
        )
        row = (_NO_LOAD if load is None else load_row(load)) + steps
        self._rows[rid] = (stats, version, row, steps)
        return row

    def _report(self, rid: str, stats: Optional[dict]) -> Optional[Report]:
        """Parsed once per report Serve delivers (a new dict each time), not once per decision."""
        cached = self._reports.get(rid)
        if cached is not None and cached[0] is stats:
            return cached[1]
        report = Report.parse(stats)
        if report is not None:
            self._lora_ids.update(report.loras)
            self.index.set_capacity(rid, report.kv_blocks_total)
            self.ledger.reported(rid, report)
        self._reports[rid] = (stats, report)
        return report

    # ---- Serve's lifecycle hooks -------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key, rid = pending_request.metadata.internal_request_id, replica_id.unique_id
        if replica_id not in self.curr_replicas:  # it left meanwhile: nothing counts on it
            self.ledger.forget(key)
            return
        request, cached = self.ledger.request(key), None
        if request is not None:
            self._sent_adapter(request, rid)
        if request is not None and self.ledger.replica_of(key) not in (None, rid):
            cached = self._cached_tokens(request, self.index.matched_blocks(request.hashes).get(rid, 0))
        self.ledger.routed(key, rid, cached, time.time())
        if request is not None:
            self.sync.learned(rid, request.hashes, self.ledger.sent_on(key))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """No longer in flight; but the replica's latest report may still count it (it was taken
        before the request ended), so the ledger keeps it as a completion until a later report."""
        self.ledger.completed_on(internal_request_id, replica_id.unique_id, time.time())

    def record_answer(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """The hook for answers (router.feedback reaches it through the caller's handle): request
        `request_id`, routed here, finished with `output_token_ids`. Its blocks stay cached on the
        replica that computed them, and its length feeds the decode estimate of requests whose
        max_tokens is not binding. Safe from any thread: applied on the loop Serve routes on (Serve
        may run routers in a thread of their own, apart from the caller's loop)."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is not None and loop is not here and loop.is_running():
            loop.call_soon_threadsafe(self._record_answer, request_id, prompt_token_ids, output_token_ids)
        else:
            self._record_answer(request_id, prompt_token_ids, output_token_ids)

    def _record_answer(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        found = self.ledger.answered(request_id)
        if found is None:  # not routed here, failed, or its replica left (the ledger dropped it)
            return
        rid, request = found
        m, n = self._mean_output_tokens, len(output_token_ids)
        self._mean_output_tokens = n if m is None else 0.95 * m + 0.05 * n
        # The engine's chain over prompt + answer, continued from the prompt's hashes.
        tokens = list(prompt_token_ids) + list(output_token_ids)
        hashes = cacheable_block_hashes(tokens, self.shape.block_size, request.root, known=request.hashes)
        self.index.insert(rid, hashes)
        extends = (request.request_id, len(request.hashes)) if request.request_id else None
        self.sync.learned(rid, hashes, extends=extends)

    def _learned_elsewhere(
        self, rid: str, keys: List[bytes], sent: Optional[Routed] = None, ended: Optional[str] = None
    ) -> None:
        """Another router of this deployment learned that `rid` caches a chain (`keys`: the routing keys
        of the blocks the index keeps of it), and (`sent`) has just sent it that request: it counts
        there until `rid`'s reports do, or until that router hears its answer (`ended`: its request id)."""
        if rid not in self._alive:
            return
        if keys:
            self.index.insert_keys(rid, keys)
        if sent is not None:
            self.ledger.sent_elsewhere(rid, sent, (self._reports.get(rid) or (None, None))[1], time.time())
        if ended is not None:
            self.ledger.ended_elsewhere(rid, ended)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        try:  # Serve tells a router its replicas on the loop it routes on: exchange from then on
            asyncio.get_running_loop()
            self.sync.start(self._learned_elsewhere)
        except RuntimeError:
            pass
        alive = self._alive = {r.replica_id.unique_id for r in replicas}
        if self.config.follow_evictions:  # Serve calls this with each broadcast of the replicas' reports
            for r in replicas:
                self.evictions.read(r.replica_id.unique_id, r.routing_stats)
        for rid in (self.ledger.replicas() | set(self.index.replicas()) | set(self._reports)) - alive:
            self._drop(rid)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop(replica_id.unique_id)

    def _drop(self, rid: str) -> None:
        """Replica `rid` is gone: its requests, completions, awaited answers, blocks and report."""
        self._alive.discard(rid)
        self.ledger.drop_replica(rid)
        self.index.remove_replicas([rid])
        self.evictions.drop(rid)
        self._reports.pop(rid, None)
        self._rows.pop(rid, None)
        for sent in self._adapter_sent.values():
            sent.pop(rid, None)
