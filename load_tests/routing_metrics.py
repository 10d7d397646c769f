"""What one run of `load_tests.routing` measured for one router: the load generator's summary, the
requests in flight per replica and their balance, and what the routers exchanged; its rounds pooled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from batcher.block_hash import ROUTING_KEY_BYTES
from load_tests.bench_client import BenchRecord
from load_tests.bench_metrics import summarize as summarize_load
from load_tests.routing_replay import REPLICA_HEADER, p50_p90_ms


def inflight_imbalance(records: Sequence[BenchRecord], num_replicas: int) -> Optional[float]:
    """Max/mean in-flight requests per replica, averaged over time weighted by the requests in flight
    (an imbalance matters when there is load: the tail of a run, one request left on one replica,
    weighs little), from when each request was in flight and which replica served it
    (X-Iterserve-Replica). Replicas that served nothing count as idle ones."""
    served = [
        (r.start_s, r.start_s + r.e2e_s, r.headers[REPLICA_HEADER]) for r in records if REPLICA_HEADER in r.headers
    ]
    replicas = sorted({replica for _, _, replica in served})
    if not replicas:
        return None
    events = sorted(
        [(start, 1, replica) for start, _, replica in served] + [(end, -1, replica) for _, end, replica in served]
    )
    count, weighted, total, last = dict.fromkeys(replicas, 0), 0.0, 0.0, events[0][0]
    for t, delta, replica in events:
        n = sum(count.values())
        if n:  # dt x n x (max / mean) = dt x max x replicas
            weighted += (t - last) * max(count.values()) * max(num_replicas, len(replicas))
            total += (t - last) * n
        count[replica] += delta
        last = t
    return weighted / total if total else None


def summarize(records: Sequence[BenchRecord], wall_s: float, num_replicas: int) -> dict:
    s = summarize_load(records, wall_s)
    ok = [r for r in records if r.ok]
    return {
        "requests": s["requests"],
        "failed": s["failed"],
        "cached_share": s.get("cached_token_share", 0.0),
        "ttft_ms_p50": s["ttft_ms"]["p50"],
        "ttft_ms_p90": s["ttft_ms"]["p90"],
        "ttft_ms_p99": s["ttft_ms"]["p99"],
        "output_tokens_per_s": s["output_throughput"],
        "wall_s": wall_s,
        "inflight_max_over_mean": inflight_imbalance(ok, num_replicas),
        # Little's law: the requests in flight per replica, on average over the run.
        "inflight_per_replica": sum(r.e2e_s for r in ok) / max(1e-9, wall_s) / num_replicas,
    }


def exchange_volume(app: str, before: Optional[dict], after: Optional[dict], wall_s: float) -> Optional[dict]:
    """What the app's routers exchanged (router.index_exchange) over a run of `wall_s`, from the
    board's counts before and after it: per second, and the board's CPU share."""
    if after is None:
        return None

    def total(stats):
        rows = [c for d, c in (stats or {}).get("deployments", {}).items() if d.startswith(f"{app}/")]
        return {k: sum(c[k] for c in rows) for k in ("pushes", "pulls", "entries_in", "hashes_in", "hashes_out")}

    a, b = total(after), total(before)
    per_s = {f"{k}_per_s": (a[k] - b[k]) / wall_s for k in a}
    # Each block crosses as its routing key; what crosses the wire is both directions, pickled (a little more).
    return {
        **per_s,
        "kb_per_s": ROUTING_KEY_BYTES * (per_s["hashes_in_per_s"] + per_s["hashes_out_per_s"]) / 1000,
        "board_cpu_share": (after["cpu_s"] - (before or {"cpu_s": 0.0})["cpu_s"]) / wall_s,
    }


@dataclass
class RoundResult:
    """One router's run of one workload in one round of `load_tests.routing --rounds`."""

    metrics: dict
    records: List[BenchRecord]
    wall_s: float
    samples: Dict[str, np.ndarray]  # per-request seconds by figure (routing_replay.decisions_ttfts)


def pool_rounds(rounds: Sequence[RoundResult], num_replicas: int) -> dict:
    """One router's figures over every round of a workload: the client's (TTFT percentiles, cached
    share, failures, throughput) from every round's requests together, the replayed and outside-engine
    percentiles from every round's per-request samples, the in-flight balance, the exchange's rates and
    the rest the rounds' mean; each round's own under "rounds". One round: its figures as they are."""
    if len(rounds) == 1:
        return rounds[0].metrics
    pooled = summarize([r for x in rounds for r in x.records], sum(x.wall_s for x in rounds), num_replicas)
    del pooled["inflight_max_over_mean"]  # the rounds' start times overlap: their mean, below
    # A round where a request failed has no replayed figures (decisions_ttfts): the others still pool.
    for name in dict.fromkeys(n for x in rounds for n in x.samples):
        pooled.update(p50_p90_ms(name, np.concatenate([x.samples[name] for x in rounds if name in x.samples])))
    out = {}
    for key in dict.fromkeys(k for x in rounds for k in x.metrics):
        values = [x.metrics[key] for x in rounds if x.metrics.get(key) is not None]
        if key in pooled:
            out[key] = pooled[key]
        elif values and isinstance(values[0], dict):  # the exchange's rates
            out[key] = {k: _mean([v.get(k) for v in values]) for k in values[0]}
        elif values and all(isinstance(v, (int, float)) for v in values):
            out[key] = _mean(values)
        else:
            out[key] = values[0] if values else None
    out["rounds"] = [x.metrics for x in rounds]
    return out


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
