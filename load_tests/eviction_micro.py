"""`python -m load_tests.eviction_micro`: what the replicas' eviction reports cost at fleet scale.

No Serve, no GPU: the real parts the reports go through, driven at a fleet's churn. Each of N
replicas evicts E blocks a second through its own `EvictionLog` (the engine's side) and cuts a
report every period; like Serve's controller, every tick (0.1 s: its control loop) with a new report
broadcasts every replica's latest report, pickled; the router unpickles each broadcast and its
`EvictionFeed` applies what is new to a `PrefixIndex` that holds each replica's KV blocks (one in
`--stride` of them, and the replicas log only those evicted, as a deployment does). Times each
side per second of fleet time, and the bytes each router receives. The churn is a parameter: an 8B
replica on an H100 prefilling ~20,000 uncached tokens a second into a full cache of 16-token blocks
evicts ~1,250 blocks a second (arithmetic from the preset, not a measured GPU). `--ray` also times a
broadcast through a local Ray actor call, started and stopped by this run.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from collections import deque
from typing import List, Optional, Sequence, Tuple

from batcher.eviction_log import EvictionLog
from router.config import DEFAULT_INDEX_STRIDE_BLOCKS
from router.eviction_feed import EvictionFeed
from router.index import PrefixIndex

TICK_S = 0.1  # Serve's controller loop (CONTROL_LOOP_INTERVAL_S): at most one broadcast a tick
CHAIN = 64  # blocks per cached prompt


def _hashes(n: int) -> List[bytes]:
    return [os.urandom(32) for _ in range(n)]


def measure(
    replicas: int,
    evicted_per_s: int,
    kv_blocks: int,
    period_s: float,
    seconds: int,
    stride: int = DEFAULT_INDEX_STRIDE_BLOCKS,
) -> Tuple[dict, list]:
    """One fleet's run: its figures, and the last broadcast (for `ray_call_ms`). `stride`: the index
    keeps one block of a chain in this many, and the replicas log only those (deployments.app)."""
    # Room for the blocks evicted since the last report read: the feed, not the index's own LRU, drops
    # them (the worst case for the feed: every key it is sent is found and removed).
    index = PrefixIndex(kv_blocks + 3 * round(evicted_per_s * period_s), stride)
    feed = EvictionFeed(index)
    logs = {f"r{i}": EvictionLog(stride=stride) for i in range(replicas)}
    cached = {rid: deque() for rid in logs}  # each replica's blocks (hash, place in its chain), oldest first
    for rid in logs:  # full caches: every replica holds kv_blocks blocks, in chains
        for chain in (_hashes(CHAIN) for _ in range(kv_blocks // CHAIN)):
            index.insert(rid, chain)
            cached[rid].extend(reversed(list(enumerate(chain))))  # the engine frees a chain's tail first
    reports = {rid: {"evicted": []} for rid in logs}
    # Replica i reports at i/replicas of the period (Serve randomizes each one's period by 10%).
    due = {rid: period_s * i / replicas for i, rid in enumerate(logs)}
    engine_s = cut_s = dumps_s = loads_s = router_s = 0.0
    broadcast: list = []
    report_bytes, broadcast_bytes, broadcasts = [], [], 0
    per_tick = max(1, round(evicted_per_s * TICK_S))
    for tick in range(round(seconds / TICK_S)):
        now, changed = tick * TICK_S, False
        for rid, log in logs.items():
            fresh = _hashes(per_tick)  # the engine caches new blocks and evicts as many of its oldest
            index.insert(rid, fresh)  # what the router learns of them (not the feed's cost: untimed)
            cached[rid].extend(reversed(list(enumerate(fresh))))
            gone = [cached[rid].popleft() for _ in range(per_tick)]
            t0 = time.perf_counter()
            for i, h in gone:
                log.evicted(h, i)
            engine_s += time.perf_counter() - t0
            if now >= due[rid]:
                t0 = time.perf_counter()
                reports[rid] = {"evicted": log.cut()}
                cut_s += time.perf_counter() - t0
                report_bytes.append(len(pickle.dumps(reports[rid])))
                due[rid] += period_s
                changed = True
        if not changed:
            continue
        t0 = time.perf_counter()
        blob = pickle.dumps(list(reports.items()), protocol=5)  # the controller, once per listener
        dumps_s += time.perf_counter() - t0
        broadcast_bytes.append(len(blob))
        broadcasts += 1
        t0 = time.perf_counter()
        broadcast = pickle.loads(blob)
        t1 = time.perf_counter()
        for rid, stats in broadcast:  # the router: Serve's update_replicas -> the feed
            feed.read(rid, stats)
        loads_s, router_s = loads_s + t1 - t0, router_s + time.perf_counter() - t1
    per_s = 1e3 / seconds
    return {
        "replicas": replicas,
        "stride": stride,
        "evicted_per_s": evicted_per_s,
        "kv_blocks": kv_blocks,
        "period_s": period_s,
        "seconds": seconds,
        "report_bytes_p50": statistics.median(report_bytes),
        "broadcast_bytes_p50": statistics.median(broadcast_bytes),
        "broadcasts_per_s": broadcasts / seconds,
        "router_bytes_per_s": sum(broadcast_bytes) / seconds,
        "engine_log_us_per_block": engine_s / (seconds * evicted_per_s * replicas) * 1e6,
        "replica_cut_ms_per_report": cut_s / len(report_bytes) * 1e3,
        "controller_dumps_ms_per_s": dumps_s * per_s,
        "router_loads_ms_per_s": loads_s * per_s,
        "router_feed_ms_per_s": router_s * per_s,
        "dropped_per_s": feed.dropped / seconds,
        "gaps": feed.gaps,
    }, broadcast


def ray_call_ms(broadcast: list, calls: int = 40) -> float:
    """Milliseconds one actor call returning `broadcast` takes through Ray (the path of Serve's long poll:
    the controller's `listen_for_change` returns each router its update), the median of `calls`."""
    import ray

    @ray.remote(num_cpus=0)
    class Host:
        def __init__(self, payload):
            self.payload = payload

        def get(self):
            return self.payload

    host = Host.remote(broadcast)
    ray.get(host.get.remote())
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(host.get.remote())
        times.append(time.perf_counter() - t0)
    ray.kill(host)
    return statistics.median(times) * 1e3


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="python -m load_tests.eviction_micro", description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="4,16,64")
    p.add_argument("--evicted-per-s", type=int, default=1250, help="blocks each replica evicts a second")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=28000,
        help="each replica's cache (an 8B on an H100: ~28,000 blocks of 16 tokens)",
    )
    p.add_argument("--period-s", type=float, default=1.0, help="request_routing_stats_period_s")
    p.add_argument("--seconds", type=int, default=10, help="fleet time simulated")
    p.add_argument(
        "--stride",
        type=int,
        default=DEFAULT_INDEX_STRIDE_BLOCKS,
        help="the index keeps one block of a chain in this many and the "
        "replicas log only those (default: LLMRouter's, 4: 32 tokens of 8-token blocks); 1: every block",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="also time each broadcast through a local Ray actor call, "
        "with and without the evictions (starts Ray on this machine, stops it after)",
    )
    p.add_argument("--json", default="", help="write the rows here too")
    args = p.parse_args(argv)
    if args.ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(
        f"{'replicas':>8} {'evict/s':>8} {'report':>8} {'broadcast':>10} {'per router':>11} {'bcasts/s':>8} "
        f"{'log/block':>10} {'cut':>7} {'controller':>11} {'router loads':>13} {'feed':>10} {'Ray +':>10}"
    )
    rows = []
    try:
        for n in map(int, args.replicas.split(",")):
            r, broadcast = measure(n, args.evicted_per_s, args.kv_blocks, args.period_s, args.seconds, args.stride)
            ray_extra = "-"
            if args.ray:  # the evictions' share of a broadcast's Ray call, times broadcasts a second
                r["ray_call_ms"] = ray_call_ms(broadcast)
                r["ray_call_ms_without_evictions"] = ray_call_ms([(rid, {"evicted": []}) for rid, _ in broadcast])
                r["ray_ms_per_s"] = (r["ray_call_ms"] - r["ray_call_ms_without_evictions"]) * r["broadcasts_per_s"]
                ray_extra = f"{r['ray_ms_per_s']:>6.1f}ms/s"
            rows.append(r)
            print(
                f"{n:>8} {r['evicted_per_s']:>8} {r['report_bytes_p50'] / 1e3:>6.1f}KB "
                f"{r['broadcast_bytes_p50'] / 1e3:>8.0f}KB {r['router_bytes_per_s'] / 1e6:>7.2f}MB/s "
                f"{r['broadcasts_per_s']:>8.1f} {r['engine_log_us_per_block']:>8.2f}us "
                f"{r['replica_cut_ms_per_report']:>5.2f}ms {r['controller_dumps_ms_per_s']:>7.1f}ms/s "
                f"{r['router_loads_ms_per_s']:>9.1f}ms/s {r['router_feed_ms_per_s']:>6.1f}ms/s {ray_extra:>10}"
            )
    finally:
        if args.ray:
            ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
