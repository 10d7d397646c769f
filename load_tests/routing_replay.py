"""What a router's decisions cost in engine time, apart from Serve's plumbing: the trace's requests
replayed through the preset's step-time model on the replicas they were sent to.

`python -m load_tests.routing` measures TTFT at the client: the engine's queueing and prefill plus
every hop through Serve (proxy, ingress, handle, replica), which on a 2-core machine under load is
tens of milliseconds and noisy. To tell a router's decisions from that, each request is replayed at
its arrival time on the replica the router chose (the answer's X-Iterserve-Replica header) through a
model of the engine: each step decodes the running sequences, then prefills waiting prompts in
arrival order in chunks up to max_num_batched_tokens (at most max_num_seqs sequences), timed by the
preset's step-time model; a replica caches every prompt it has computed (the benchmark gives the
trace's prefixes room). A request's first token comes at the end of the step computing its prompt's
last chunk. The same replay with LLMRouter's scoring fed the model's exact loads (`exact_loads`) is
the yardstick: where its decisions would be with perfect information. A model, not a measurement.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set

import numpy as np

from batcher.block_hash import cacheable_block_hashes, root_hash
from batcher.simulated import StepTimeModel
from deployments.prompts import prompt_token_ids
from deployments.protocol import GenerateRequest
from load_tests.bench_client import BenchRecord, BenchRequest
from load_tests.routing_trace import cached_tokens, leading_blocks
from router.config import LLMRouterConfig
from router.load_bound import LoadWindow
from router.scoring import EngineShape, FleetLoads, RoutingRequest, score_replicas

REPLICA_HEADER = "x-iterserve-replica"  # the ingress's X-Iterserve-Replica, as the client records it
TIMING_HEADER = "server-timing"  # the ingress's Server-Timing: prepare, replica-ttft, ttft (ms)


@dataclass
class ReplicaModel:
    """One replica's engine in the replay: prompts waiting [request, tokens left to prefill], sequences
    decoding [request, tokens left to generate, context], the block hashes it has computed."""

    waiting: Deque[list] = field(default_factory=deque)
    running: List[list] = field(default_factory=list)
    cached: Set[bytes] = field(default_factory=set)
    stepping: bool = False
    busy_s: float = 0.0  # time spent stepping

    def queued_tokens(self) -> float:
        return float(sum(w[1] for w in self.waiting))


@dataclass
class Replay:
    ttft_s: List[float]
    cached_tokens: List[int]

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile(self.ttft_s, q) * 1000)


Chooser = Callable[[int, List[ReplicaModel], List[int], float], int]  # (request, fleet, hits, now) -> replica


def replay(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    arrivals: Sequence[float],
    choose: Chooser,
    step: StepTimeModel,
    shape: EngineShape,
    replicas: int,
) -> Replay:
    """Each request, at its arrival, on the replica `choose` names, through the engine model."""
    root = root_hash("replay")
    hashes = [cacheable_block_hashes(p, shape.block_size, root) for p in prompts]
    fleet = [ReplicaModel() for _ in range(replicas)]
    ttft: List[float] = [math.nan] * len(prompts)
    cached = [0] * len(prompts)
    events = [(t, 1, i) for i, t in enumerate(arrivals)]  # (time, 0: a step ends / 1: arrival, index)
    heapq.heapify(events)
    steps = {}

    def start_step(k: int, now: float) -> None:
        rep = fleet[k]
        decode = rep.running[: shape.max_num_seqs]
        budget, chunks, seqs = shape.max_num_batched_tokens - len(decode), [], len(decode)
        for w in rep.waiting:
            if budget <= 0 or seqs >= shape.max_num_seqs:
                break
            n = min(budget, w[1])
            chunks.append((w, n))
            budget, seqs = budget - n, seqs + 1
        if not decode and not chunks:
            rep.stepping = False
            return
        seconds = step.step_seconds(sum(n for _, n in chunks), len(decode), sum(d[2] for d in decode))
        rep.stepping, rep.busy_s, steps[k] = True, rep.busy_s + seconds, (decode, chunks)
        heapq.heappush(events, (now + seconds, 0, k))

    while events:
        now, kind, x = heapq.heappop(events)
        if kind == 1:
            hits = [leading_blocks(hashes[x], rep.cached) for rep in fleet]
            k = choose(x, fleet, hits, now)
            cached[x] = cached_tokens(hits[k], len(prompts[x]), shape.block_size)
            fleet[k].waiting.append([x, len(prompts[x]) - cached[x]])
            fleet[k].cached.update(hashes[x])
            if not fleet[k].stepping:
                start_step(k, now)
            continue
        decode, chunks = steps.pop(x)
        rep = fleet[x]
        for d in decode:
            d[1], d[2] = d[1] - 1, d[2] + 1
        rep.running = [d for d in rep.running if d[1] > 0]
        for w, n in chunks:
            w[1] -= n
            if w[1] <= 0:
                rep.waiting.remove(w)
                i = w[0]
                ttft[i] = now - arrivals[i]
                if max_tokens[i] > 1:
                    rep.running.append([i, max_tokens[i] - 1, len(prompts[i])])
        start_step(x, now)
    return Replay(ttft, cached)


def assigned(replica_of: Sequence[str]) -> Chooser:
    """The replicas a run's router chose (one name per request, in request order)."""
    names = sorted(set(replica_of))
    return lambda i, fleet, hits, now: names.index(replica_of[i])


class RouterScoring:
    """LLMRouter's scoring (router.scoring.score_replicas, its default knobs unless `config`) as the
    replays run it, given the loads a router would see: the load bound's recent peak, the mean answer
    so far as the expected one, the fleet's busy share as the model's."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        step: StepTimeModel,
        shape: EngineShape,
        config: Optional[LLMRouterConfig] = None,
        seed: int = 0,
    ):
        self.prompts, self.max_tokens, self.step, self.shape = prompts, max_tokens, step, shape
        self.config = config or LLMRouterConfig(model="replay")
        self.rng, self.window, self.seen = np.random.default_rng(seed), LoadWindow(self.config.load_window_s), []

    def choose(self, i: int, fleet: List[ReplicaModel], hits: List[int], now: float, loads: FleetLoads) -> int:
        config, prompt = self.config, self.prompts[i]
        cached = np.array([cached_tokens(h, len(prompt), self.shape.block_size) for h in hits], dtype=float)
        expected = sum(self.seen) / len(self.seen) if self.seen else config.default_output_tokens
        self.seen.append(self.max_tokens[i])
        request = RoutingRequest(len(prompt), max(1, round(min(self.max_tokens[i], expected))))
        busy = sum(rep.busy_s for rep in fleet) / (len(fleet) * now) if now > 0 else 0.0
        ids = list(range(len(fleet)))
        ranking = score_replicas(
            self.step,
            self.shape,
            [str(k) for k in ids],
            loads,
            cached,
            request,
            config.load_bound,
            config.affinity_margin,
            self.rng,
            fleet_sequences=self.window.peak(now, float(loads.batch.sum())),
            fleet_busy=busy,
            recent_routes=self.window.recent_routes(now, ids),
        )
        best = int(ranking.order[0])
        self.window.routed(now, best)
        return best


def exact_loads(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    step: StepTimeModel,
    shape: EngineShape,
    config: Optional[LLMRouterConfig] = None,
    seed: int = 0,
) -> Chooser:
    """LLMRouter's scoring over the model's exact loads and caches (RouterScoring)."""
    scoring = RouterScoring(prompts, max_tokens, step, shape, config, seed)

    def choose(i: int, fleet: List[ReplicaModel], hits: List[int], now: float) -> int:
        loads = FleetLoads(
            np.array([rep.queued_tokens() for rep in fleet]),
            np.array([float(len(rep.waiting) + len(rep.running)) for rep in fleet]),
            np.array(
                [float(sum(d[2] for d in rep.running) + sum(len(prompts[w[0]]) for w in rep.waiting)) for rep in fleet]
            ),
            np.full(len(fleet), math.nan),
        )
        return scoring.choose(i, fleet, hits, now, loads)

    return choose


def chat_turns(work: Sequence[BenchRequest], records: Sequence[BenchRecord], tokenizer) -> tuple:
    """A chat run's answered turns as the replay's requests, in the order they were sent: (prompts,
    max_tokens, arrivals, replicas, records). Each turn's prompt is its session's history rebuilt
    from the answers recorded, in the engine's tokens (the ingress's template and tokenizer); its send
    time is its arrival. The replay's caches start cold (the real fleet's hold the system prompts of
    the workloads before)."""
    answers = {(r.index, r.turn): r.output_text for r in records if r.ok}
    turns = []
    for r in sorted((r for r in records if r.ok), key=lambda r: r.start_s):
        req = work[r.index]
        history = list(req.messages)
        for t in range(r.turn):
            history += [
                {"role": "assistant", "content": answers[(r.index, t)]},
                {"role": "user", "content": req.followups[t]},
            ]
        ids = prompt_token_ids(tokenizer, GenerateRequest(messages=history))
        turns.append((ids, req.max_tokens, r.start_s, r.headers.get(REPLICA_HEADER), r))
    return tuple(map(list, zip(*turns))) if turns else ([], [], [], [], [])


def decisions_ttfts(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    arrivals: Sequence[float],
    replica_of: Sequence[Optional[str]],
    step: StepTimeModel,
    shape: EngineShape,
    replicas: int,
    records: Optional[Sequence[Optional[BenchRecord]]] = None,
    samples: Optional[Dict[str, np.ndarray]] = None,
) -> dict:
    """For the routing benchmark: TTFT p50/p90 (ms) of a run's decisions in the model; none when a
    request has no replica (it failed). With the client's records (request order, None where one
    failed), also what each request spent outside the modelled engine (client TTFT less modelled),
    and its parts from the ingress's Server-Timing header: the replica's own TTFT against the model's,
    the ingress's prepare, routing and Serve's hops (its ttft less prepare and replica-ttft: the
    request's way to the replica, the decision included, and the first chunk's way back,
    from-replica), the proxy and HTTP (the client's TTFT less the ingress's). `samples`, when given,
    gets each figure's per-request seconds by name (rounds of a run are pooled from them)."""
    if not all(replica_of):
        return {}
    r = replay(prompts, max_tokens, arrivals, assigned(replica_of), step, shape, replicas)
    modelled = np.array(r.ttft_s)
    out = p50_p90_ms("modelled_ttft", modelled)
    if samples is not None:
        samples["modelled_ttft"] = modelled
    if records is None:
        return out
    client = np.array([x.ttft_s if x and x.ttft_s is not None else math.nan for x in records], dtype=float)
    timing = np.array([server_timing(x.headers.get(TIMING_HEADER) if x else None) for x in records], dtype=float)
    prepare, replica_ttft, ingress_ttft, from_replica = (timing[:, i] / 1000 for i in range(4))
    parts = {
        "outside_engine": client - modelled,
        "replica_ttft": replica_ttft,
        "replica_over_model": replica_ttft - modelled,
        "prepare": prepare,
        "routing_and_hops": ingress_ttft - prepare - replica_ttft,
        "to_replica": ingress_ttft - prepare - replica_ttft - from_replica,
        "from_replica": from_replica,
        "proxy_and_http": client - ingress_ttft,
    }
    for name, seconds in parts.items():
        out.update(p50_p90_ms(name, seconds))
        if samples is not None:
            samples[name] = seconds
    return out


def p50_p90_ms(name: str, seconds: np.ndarray) -> dict:
    """{name_ms_p50, name_ms_p90} of per-request seconds (NaN where a request lacks the figure); none if all do."""
    if np.isnan(seconds).all():
        return {}
    return {
        f"{name}_ms_p50": float(np.nanpercentile(seconds, 50) * 1000),
        f"{name}_ms_p90": float(np.nanpercentile(seconds, 90) * 1000),
    }


# The parts of a request's TTFT the ingress's Server-Timing header tells (decisions_ttfts' keys).
TTFT_PARTS = (
    ("replica TTFT", "replica_ttft"),
    ("replica - replayed", "replica_over_model"),
    ("prepare", "prepare"),
    ("routing and hops", "routing_and_hops"),
    ("of it to the replica", "to_replica"),
    ("and back", "from_replica"),
    ("proxy and HTTP", "proxy_and_http"),
)


def ttft_parts_line(m: dict) -> str:
    return (
        ", ".join(
            f"{what} p50 {m[f'{key}_ms_p50']:.0f} / p90 {m[f'{key}_ms_p90']:.0f}"
            for what, key in TTFT_PARTS
            if f"{key}_ms_p50" in m
        )
        + " ms"
    )


def server_timing(header: Optional[str]) -> tuple:
    """(prepare, replica-ttft, ttft, from-replica) in ms from a Server-Timing header; NaN for what it lacks."""
    found = {}
    for part in (header or "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            found[name] = float(dur)
    return tuple(found.get(name, math.nan) for name in ("prepare", "replica-ttft", "ttft", "from-replica"))


def exact_loads_ttfts(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    arrivals: Sequence[float],
    step: StepTimeModel,
    shape: EngineShape,
    replicas: int,
) -> dict:
    """For the routing benchmark: TTFT p50/p90 (ms) of LLMRouter's scoring with exact loads, the
    yardstick of the same arrivals (the trace's: one per fleet; a chat run's: its own)."""
    r = replay(prompts, max_tokens, arrivals, exact_loads(prompts, max_tokens, step, shape), step, shape, replicas)
    return {"exact_loads_ttft_ms_p50": r.ttft_ms(50), "exact_loads_ttft_ms_p90": r.ttft_ms(90)}
