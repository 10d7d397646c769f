"""`python -m load_tests.soak --minutes M --rate R`: a bounded soak of mixed traffic, and its verdict.

Mixed traffic at Poisson rate R for M minutes (load_tests/soak_traffic.py: streams, non-streamed
requests, client disconnects mid-stream, bad requests that must get a 4xx). Then it reports requests
by kind and outcome, the unexpected error rate (expected 4xx excluded), lost requests, latency p50/p99
of the first fifth of the run against the last fifth (drift), the LLM replicas' RSS (growth from the
end of the first fifth, after warm-up, to after the traffic drained) and whether every KV block is
free again. Targets (for 10 minutes on this machine): 0 unexpected errors, no lost request,
RSS growth < 5%, p99 drift < 20%, all KV blocks free. Runs shorter than --enforce-all-from-min report
RSS growth and drift without enforcing them (warm-up and noise dominate short runs). Exit code 1 when
an enforced target is missed.

By default it starts its own local Ray cluster and Serve app (serve_config.yaml's application, with
--model swapped in); --base-url targets a running server instead (replica RSS and KV blocks then come
from --ray-address and --app, or from this process's Ray when it has one; else they are not measured).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

from cluster.local_serve import local_serve
from load_tests.bench_metrics import percentile
from load_tests.soak_traffic import DEFAULT_MIX, KINDS, OUTCOMES, SoakRecord, run_traffic

SERVE_CONFIG = Path(__file__).resolve().parent.parent / "serve_config.yaml"
TARGETS = {"unexpected_errors": 0, "lost": 0, "rss_growth_pct": 5.0, "p99_drift_pct": 20.0}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m load_tests.soak",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=10.0)
    # 1 req/s is ~24 output tokens/s, half of what one CPU replica of serve_config.yaml sustains on 2
    # cores: a soak watches a server that keeps up; at 2 req/s the queue grows and latency drifts by design.
    p.add_argument("--rate", type=float, default=1.0, help="Poisson request rate (req/s)")
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="engine model of the app it starts (tiny-llama for a quick run)",
    )
    p.add_argument("--base-url", help="a running server instead of starting one")
    p.add_argument("--ray-address", help="with --base-url: the cluster to read replica stats from")
    p.add_argument("--app", default="iterserve", help="with --base-url and --ray-address: the Serve app name")
    p.add_argument(
        "--mix", default=",".join(f"{k}:{v:g}" for k, v in DEFAULT_MIX.items()), help="request kinds and weights"
    )
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request; no answer by then = lost")
    p.add_argument("--drain-s", type=float, default=180.0, help="wait for the last answers after the traffic")
    p.add_argument(
        "--enforce-all-from-min",
        type=float,
        default=5.0,
        help="runs at least this long also enforce the RSS and drift targets",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/soak.json")
    return p.parse_args(argv)


def parse_mix(text: str) -> Dict[str, float]:
    mix = {}
    for item in text.split(","):
        kind, _, weight = item.partition(":")
        if kind not in KINDS or not weight or float(weight) < 0:
            raise ValueError(f"--mix item {item!r}: expected KIND:WEIGHT with KIND in {KINDS}")
        mix[kind] = float(weight)
    return mix


def app_config(model: str) -> dict:
    """serve_config.yaml's application args, with the engine's model swapped in."""
    [app] = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    args = app["args"]
    if model != args["engine"]["model"]:
        args["engine"] = {**args["engine"], "model": model, "num_threads": 1, "kv_cache_memory_gib": 0.25}
    return args


# ---- replica stats (RSS, KV blocks) -------------------------------------------------------------


class ReplicaProbe:
    """Engine stats of every LLM replica of an app, through its Serve handle."""

    def __init__(self, app: str):
        from ray import serve

        self.handle = serve.get_deployment_handle("LLMServer", app)

    async def sample(self, calls: int = 12) -> Dict[str, dict]:
        """By replica id; the handle reaches a replica the router picks, so it asks a few times."""
        seen: Dict[str, dict] = {}
        for _ in range(calls):
            s = await self.handle.stats.remote()
            seen[s["replica_id"]] = s
        return seen

    async def wait_all_free(self, timeout_s: float) -> Dict[str, dict]:
        """Stats once every replica is idle with every KV block free (or the last seen at timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await self.sample()
            if all_free(stats) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.5)


def all_free(stats: Dict[str, dict]) -> bool:
    return bool(stats) and all(
        s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats.values()
    )


# ---- the run ------------------------------------------------------------------------------------


async def soak(
    base_url: str,
    minutes: float,
    rate: float,
    probe: Optional[ReplicaProbe],
    mix=DEFAULT_MIX,
    seed: int = 0,
    timeout_s: float = 120.0,
    drain_s: float = 180.0,
) -> dict:
    """Runs the traffic, samples replica RSS at the start, after the first fifth and at the end."""
    duration = minutes * 60.0
    rss: Dict[str, Optional[Dict[str, int]]] = {"before": None, "after_warmup": None, "end": None}

    async def rss_now():
        return {rid: s["rss_bytes"] for rid, s in (await probe.sample()).items()}

    async def after_warmup():
        await asyncio.sleep(duration / 5)
        rss["after_warmup"] = await rss_now()

    if probe:
        rss["before"] = await rss_now()
        warm = asyncio.create_task(after_warmup())
    t0 = time.monotonic()
    records = await run_traffic(base_url, duration, rate, mix, seed, timeout_s, drain_s)
    wall = time.monotonic() - t0
    end_stats = None
    if probe:
        await warm
        end_stats = await probe.wait_all_free(timeout_s=30.0)
        rss["end"] = {rid: s["rss_bytes"] for rid, s in end_stats.items()}
    return report(records, minutes, rate, wall, rss, end_stats)


def report(
    records: List[SoakRecord],
    minutes: float,
    rate: float,
    wall_s: float,
    rss: dict,
    end_stats: Optional[Dict[str, dict]],
) -> dict:
    counts = {k: {o: sum(r.kind == k and r.outcome == o for r in records) for o in OUTCOMES} for k in KINDS}
    errors = [r for r in records if r.outcome == "error"]
    lost = [r for r in records if r.outcome == "lost"]
    judged = [r for r in records if r.kind != "bad"]
    duration = minutes * 60.0
    first = [r for r in records if r.outcome == "ok" and r.start_s < duration / 5]
    last = [r for r in records if r.outcome == "ok" and r.start_s >= duration * 4 / 5]
    latency = {}
    for metric in ("e2e_s", "ttft_s"):
        for p in (50, 99):
            a = percentile([getattr(r, metric) for r in first if getattr(r, metric) is not None], p)
            b = percentile([getattr(r, metric) for r in last if getattr(r, metric) is not None], p)
            drift = None if not a or b is None else 100.0 * (b - a) / a
            latency[f"{metric[:-2]}_p{p}"] = {
                "first_fifth_ms": a and a * 1000,
                "last_fifth_ms": b and b * 1000,
                "drift_pct": drift,
            }
    growth = None
    if rss.get("after_warmup") and rss.get("end"):
        growth = max(100.0 * (rss["end"][rid] - v) / v for rid, v in rss["after_warmup"].items() if rid in rss["end"])
    return {
        "minutes": minutes,
        "rate": rate,
        "wall_s": wall_s,
        "requests": len(records),
        "by_kind": counts,
        "unexpected_errors": len(errors),
        "unexpected_error_rate": len(errors) / max(1, len(judged)),
        "lost": len(lost),
        "latency": latency,
        "rss_bytes": rss,
        "rss_growth_pct": growth,
        "kv_blocks": None
        if end_stats is None
        else {rid: {"free": s["kv_blocks_free"], "total": s["kv_blocks_total"]} for rid, s in end_stats.items()},
        "kv_blocks_all_free": None if end_stats is None else all_free(end_stats),
        "errors": [{"kind": r.kind, "status": r.status, "error": r.error, "start_s": r.start_s} for r in errors + lost][
            :50
        ],
    }


def verdict(rep: dict, enforce_all: bool) -> Dict[str, dict]:
    """Each target: value, target, met (None: not measured), enforced."""
    drift = rep["latency"]["e2e_p99"]["drift_pct"]
    rows = {
        "unexpected_errors": (rep["unexpected_errors"], "== 0", rep["unexpected_errors"] == 0, True),
        "lost": (rep["lost"], "== 0", rep["lost"] == 0, True),
        "kv_blocks_all_free": (rep["kv_blocks_all_free"], "true", rep["kv_blocks_all_free"], True),
        "rss_growth_pct": (
            rep["rss_growth_pct"],
            f"< {TARGETS['rss_growth_pct']:g}",
            None if rep["rss_growth_pct"] is None else rep["rss_growth_pct"] < TARGETS["rss_growth_pct"],
            enforce_all,
        ),
        "e2e_p99_drift_pct": (
            drift,
            f"< {TARGETS['p99_drift_pct']:g}",
            None if drift is None else drift < TARGETS["p99_drift_pct"],
            enforce_all,
        ),
    }
    return {k: {"value": v, "target": t, "met": m, "enforced": e and m is not None} for k, (v, t, m, e) in rows.items()}


def _fmt(x, unit="") -> str:
    if x is None:
        return "-"
    return f"{x:.1f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def format_report(rep: dict, targets: Dict[str, dict]) -> str:
    lines = [
        f"== soak: {rep['minutes']:g} min at {rep['rate']:g} req/s (Poisson), {rep['requests']} requests, "
        f"wall {rep['wall_s']:.0f} s",
        f"{'kind':12s}" + "".join(f"{o:>14s}" for o in OUTCOMES),
    ]
    for kind, counts in rep["by_kind"].items():
        lines.append(f"{kind:12s}" + "".join(f"{counts[o]:>14d}" for o in OUTCOMES))
    lines.append(
        f"unexpected error rate {rep['unexpected_error_rate']:.2%} ({rep['unexpected_errors']} errors, "
        f"expected 4xx excluded); lost {rep['lost']}"
    )
    lines.append(f"{'latency (ok)':14s} {'first fifth':>12s} {'last fifth':>12s} {'drift':>8s}")
    for name, d in rep["latency"].items():
        lines.append(
            f"{name:14s} {_fmt(d['first_fifth_ms'], ' ms'):>12s} {_fmt(d['last_fifth_ms'], ' ms'):>12s} "
            f"{_fmt(d['drift_pct'], '%'):>8s}"
        )
    rss = rep["rss_bytes"]
    for rid in rss.get("end") or {}:
        mib = [
            None if not rss.get(k) or rid not in rss[k] else rss[k][rid] / 2**20
            for k in ("before", "after_warmup", "end")
        ]
        lines.append(
            f"replica {rid} RSS MiB: before {_fmt(mib[0])}, after the first fifth {_fmt(mib[1])}, end {_fmt(mib[2])}"
        )
    for rid, kv in (rep["kv_blocks"] or {}).items():
        lines.append(f"replica {rid} KV blocks free at the end: {kv['free']}/{kv['total']}")
    lines.append("targets:")
    for name, t in targets.items():
        state = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
        note = "" if t["enforced"] or t["met"] is None else " (reported, not enforced: short run)"
        lines.append(f"  {name:20s} {_fmt(t['value']):>10s}  (target {t['target']})  {state}{note}")
    for e in rep["errors"][:10]:
        lines.append(f"  {e['kind']} at {e['start_s']:.1f} s: status {e['status']}: {e['error'][:160]}")
    return "\n".join(lines)


@contextlib.contextmanager
def own_server(model: str):
    """A local Ray cluster (every core) and the app on it; yields (base URL, app name)."""
    with local_serve(num_cpus=os.cpu_count(), logging_level="ERROR") as server:
        yield server.deploy("soak", app_config(model)), "soak"


def _ray_connected() -> bool:
    """True when this process already has Ray (called in-process, e.g. from a test's driver)."""
    import ray

    return ray.is_initialized()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    mix = parse_mix(args.mix)
    with contextlib.ExitStack() as stack:
        if args.base_url:
            url, app = args.base_url, args.app
            if args.ray_address:
                import ray

                ray.init(address=args.ray_address, namespace="serve", log_to_driver=False)
                stack.callback(ray.shutdown)
        else:
            url, app = stack.enter_context(own_server(args.model))
        probe = ReplicaProbe(app) if (not args.base_url or args.ray_address or _ray_connected()) else None
        rep = asyncio.run(soak(url, args.minutes, args.rate, probe, mix, args.seed, args.timeout_s, args.drain_s))
    targets = verdict(rep, enforce_all=args.minutes >= args.enforce_all_from_min)
    rep["targets"] = targets
    print(format_report(rep, targets))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
        print(f"wrote {args.json}")
    return 1 if any(t["enforced"] and not t["met"] for t in targets.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
