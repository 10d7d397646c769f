"""`python -m cluster.simulate`: replay a trace through a fleet of simulated replicas under several
autoscalers and compare them.

- queue_depth: deployments.autoscaling:QueueDepthPolicy, the policy the deployment runs, with the
  config the app gives it (deployments.config.AutoscalingConfig.to_serve()): the TTFT SLO, the
  start-up time (measured after the first scale-up) and the replica's slots (max_num_seqs).
- serve_default: Serve's replica_queue_length_autoscaling_policy with Serve's own defaults (30 s
  look-back, 10 s metric pushes, 30 s / 600 s delays), target_ongoing_requests = `--target-running`
  (0.75 x max_num_seqs); Serve's delay and smoothing code runs, not a copy of it.
- clairvoyant: knows the trace; runs the fewest replicas, each filled to `--clairvoyant-fill` of what
  it can run (of max_num_seqs, and of its prefill budget: max_num_batched_tokens per step), that keep
  up with the highest rate of the next start-up period, asked for start-up seconds ahead.
- fixed: a constant fleet with queue_depth's replica-seconds (between the two whole counts around
  them, SLO share interpolated), and the smallest constant count reaching queue_depth's SLO share.

`--trace`: a rate CSV (`t_s,rate_rps`), a request trace (.csv / .jsonl, optionally .gz, see
cluster/request_traces.py) or the name of a bundled one (load_tests/traces/), binned to 10 s rates;
`--rate-scale` multiplies the rate, `--window-s START END` cuts it. With a request trace and no
`--prompt-tokens` / `--output-tokens`, its mean input and output tokens are used. Every run starts
with the fleet the clairvoyant has at t = 0 (all policies alike). Every figure is a simulation.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from ray.serve.config import AutoscalingConfig

from cluster.fleet_sim import FleetSim
from cluster.fleet_sim_parts import Policy, Result, SimWorkload
from cluster.traces import Trace, day_trace, load_csv, steady_spans
from deployments.autoscaling import SERVE_POLICY_PATH, QueueDepthPolicy
from deployments.config import AutoscalingConfig as AppAutoscaling

TARGETS = {"slo_points_over_serve": 0.05}


def load_trace(
    spec: Optional[str],
    rate_scale: float = 1.0,
    window: Optional[Tuple[float, float]] = None,
    peak_rps: float = 3000.0,
    hours: float = 4.0,
) -> Tuple[Trace, dict]:
    """The rate trace `spec` names (None: the built-in day) and what the request trace says of its
    tokens ({} for a rate trace)."""
    tokens: dict = {}
    if spec is None:
        trace = day_trace(peak_rps, hours)
    elif Path(spec).exists() and _is_rate_csv(Path(spec)):
        trace = load_csv(spec)
    else:
        from cluster.request_traces import bundled, load_request_trace

        reqs = load_request_trace(spec if Path(spec).exists() else bundled(spec))
        if window:
            reqs = reqs.window(*window)
            window = None
        tokens = {"input_tokens": float(reqs.input_tokens.mean()), "output_tokens": float(reqs.output_tokens.mean())}
        trace = reqs.to_rate(10.0)
    if window:
        t0, t1 = window
        grid = np.arange(t0, min(t1, trace.duration_s) + 1e-9, 1.0)
        trace = Trace(grid - t0, trace.rate(grid), trace.name)
    if rate_scale != 1.0:
        trace = trace.scaled(rate_scale)
    if spec is not None:
        trace.steady = steady_spans(trace)
    return trace, tokens


def _is_rate_csv(path: Path) -> bool:
    if path.suffix != ".csv":
        return False
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    return {"t_s", "rate_rps"} <= set(header)


def policies(
    work: SimWorkload, max_replicas: int, target_running: float, startup_s: float, slo_s: float = 1.0
) -> Dict[str, Policy]:
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    ours = AppAutoscaling(
        min_replicas=1, max_replicas=max_replicas, policy_kwargs={"slo_s": slo_s, "startup_s": startup_s}
    )
    serve = AppAutoscaling(
        min_replicas=1,
        max_replicas=max_replicas,
        policy=SERVE_POLICY_PATH,
        target_ongoing_requests=target_running,
        metrics_interval_s=10.0,
    )
    # The app adds the replica's slots from its engine config; here the simulated engine's.
    ours._replica_slots = work.max_num_seqs
    serve_cfg = ours.to_serve()
    return {
        "queue_depth": Policy(
            "queue_depth", QueueDepthPolicy(**serve_cfg["policy"]["policy_kwargs"]), AutoscalingConfig(**serve_cfg)
        ),
        "serve_default": Policy(
            "serve_default", replica_queue_length_autoscaling_policy, AutoscalingConfig(**serve.to_serve())
        ),
    }


def clairvoyant_schedule(trace: Trace, work: SimWorkload, startup_s: float, max_replicas: int, fill: float):
    per_replica = work.capacity_rps(fill)

    def schedule(t: float) -> int:
        need = trace.max_over(t, t + startup_s + 1.0) / per_replica
        return max(1, min(max_replicas, math.ceil(need)))

    return schedule


def reversals(res: Result, spans=None) -> int:
    """Direction changes of the target count (up then down, or down then up), within `spans`."""
    count, last = 0, 0
    for t, a, b in zip(res.t[1:], res.target[:-1], res.target[1:]):
        if b == a:
            continue
        d = 1 if b > a else -1
        inside = spans is None or any(s <= t <= e for s, e in spans)
        if last and d != last and inside:
            count += 1
        last = d
    return count


def summary(res: Result, trace: Trace, slo_s: float) -> dict:
    steady_min = sum(e - s for s, e in trace.steady) / 60.0
    return {
        "replica_seconds": round(res.replica_seconds),
        "ttft_p50_s": res.ttft_quantile(0.50),
        "ttft_p99_s": res.ttft_quantile(0.99),
        "slo_s": slo_s,
        "slo_share": res.within_slo / max(res.requests, 1e-9),
        "requests": round(res.requests),
        "served": round(res.served),
        "unserved_at_end": round(res.unfinished),
        "reversals": reversals(res),
        "reversals_steady": reversals(res, trace.steady),
        "reversals_per_10min_steady": reversals(res, trace.steady) / (steady_min / 10) if steady_min else None,
        "peak_replicas": max(res.replicas),
    }


def run_all(
    trace: Trace,
    work: SimWorkload,
    startup_s: float,
    slo_s: float,
    max_replicas: int,
    target_running: float,
    dt_s: float,
    seed: int,
    fill: float = 0.9,
    names=("queue_depth", "serve_default", "clairvoyant"),
) -> Dict[str, Result]:
    out = {}
    sched = clairvoyant_schedule(trace, work, startup_s, max_replicas, fill)
    for name, pol in policies(work, max_replicas, target_running, startup_s, slo_s).items():
        if name in names:
            out[name] = FleetSim(trace, work, startup_s, dt_s=dt_s, slo_s=slo_s, seed=seed).run(pol, initial=sched(0.0))
    out["clairvoyant"] = run_fixed(trace, work, startup_s, slo_s, dt_s, seed, sched, "clairvoyant", sched(0.0))
    return out


def run_fixed(
    trace: Trace,
    work: SimWorkload,
    startup_s: float,
    slo_s: float,
    dt_s: float,
    seed: int,
    schedule: Callable[[float], int],
    name: str,
    initial: int,
) -> Result:
    return FleetSim(trace, work, startup_s, dt_s=dt_s, slo_s=slo_s, seed=seed).run(
        schedule=schedule, initial=initial, name=name
    )


def fixed_baseline(
    trace: Trace,
    work: SimWorkload,
    startup_s: float,
    slo_s: float,
    dt_s: float,
    seed: int,
    replica_seconds: float,
    match_share: float,
    max_replicas: int,
) -> Tuple[dict, Result]:
    """The constant fleet at `replica_seconds` (SLO share interpolated between the whole counts around
    it) and the smallest constant count reaching `match_share`."""
    shares: Dict[int, Tuple[float, Result]] = {}

    def share(n: int) -> float:
        if n not in shares:
            res = run_fixed(trace, work, startup_s, slo_s, dt_s, seed, lambda t: n, f"fixed {n}", n)
            shares[n] = (res.within_slo / max(res.requests, 1e-9), res)
        return shares[n][0]

    count = replica_seconds / trace.duration_s
    low = max(1, math.floor(count))
    high = low + 1
    frac = min(1.0, max(0.0, count - low))
    at_equal = (1 - frac) * share(low) + frac * share(high)
    matched = fewest(lambda n: share(n) >= match_share, max_replicas, start=high)
    res = shares[low][1] if frac < 0.5 else shares[high][1]
    return {
        "replicas": round(count, 2),
        "replica_seconds": round(replica_seconds),
        "slo_share": at_equal,
        "replicas_to_match_queue_depth": matched,
        "replica_seconds_to_match": round(matched * trace.duration_s) if matched else None,
        "slo_share_by_count": {n: v[0] for n, v in sorted(shares.items())},
    }, res


def fewest(ok: Callable[[int], bool], max_n: int, start: int = 1) -> Optional[int]:
    """The fewest replicas n in [1, max_n] for which `ok(n)`, which holds from some n on (the SLO
    share grows with the count, and so do replica-seconds); None if not up to max_n. Doubling from
    `start`, then bisecting: a few dozen simulations at most."""
    lo, hi = 0, min(max_n, max(1, start))
    while not ok(hi):
        if hi >= max_n:
            return None
        lo, hi = hi, min(max_n, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def check_targets(s: Dict[str, dict]) -> List[dict]:
    q, d, c, f = s["queue_depth"], s["serve_default"], s["clairvoyant"], s["fixed"]
    points = TARGETS["slo_points_over_serve"]
    rows = [
        (
            "slo_share - serve_default's",
            q["slo_share"] - d["slo_share"],
            f">= {points:+.2f}",
            q["slo_share"] - d["slo_share"] >= points,
        ),
        (
            "replica-seconds / serve_default's",
            q["replica_seconds"] / d["replica_seconds"],
            "<= 1",
            q["replica_seconds"] <= d["replica_seconds"],
        ),
        (
            "slo_share - fixed fleet's (equal r-s)",
            q["slo_share"] - f["slo_share"],
            "> 0",
            q["slo_share"] > f["slo_share"],
        ),
        ("reversals - clairvoyant's", q["reversals"] - c["reversals"], "<= 0", q["reversals"] <= c["reversals"]),
    ]
    return [{"target": n, "value": v, "bound": b, "met": bool(m)} for n, v, b, m in rows]


def table(startup_s: float, s: Dict[str, dict]) -> str:
    lines = [
        f"== start-up {startup_s:.0f} s",
        f"{'policy':<14} {'replica-s':>10} {'x clairv':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'in SLO':>7} {'reversals':>9} {'steady rev':>10} {'peak':>5}",
    ]
    base = s["clairvoyant"]["replica_seconds"]
    for name, r in s.items():
        if name == "fixed":
            lines.append(
                f"{'fixed':<14} {r['replica_seconds']:>10} {r['replica_seconds'] / base:>8.2f} "
                f"{'':>9} {'':>9} {r['slo_share']:>7.2%} {0:>9} {0:>10} {r['replicas']:>5}"
            )
            m = r["replicas_to_match_queue_depth"]
            lines.append(
                f"  a constant fleet needs {m} replicas ({r['replica_seconds_to_match']} replica-s, "
                f"{r['replica_seconds_to_match'] / base:.2f}x clairvoyant) to reach queue_depth's SLO share"
                if m
                else "  no constant fleet up to --max-replicas reaches queue_depth's SLO share"
            )
            continue
        lines.append(
            f"{name:<14} {r['replica_seconds']:>10} {r['replica_seconds'] / base:>8.2f} "
            f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s {r['slo_share']:>7.2%} "
            f"{r['reversals']:>9} {r['reversals_steady']:>10} {r['peak_replicas']:>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trace",
        help="rate CSV (t_s,rate_rps), request trace file or bundled trace name (default: the built-in day, 4 h)",
    )
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply the trace's rate")
    ap.add_argument("--window-s", type=float, nargs=2, metavar=("START", "END"), help="replay only this window")
    ap.add_argument("--peak-rps", type=float, default=3000.0, help="peak rate of the built-in trace")
    ap.add_argument("--hours", type=float, default=4.0, help="length of the built-in day trace")
    ap.add_argument(
        "--startup-s",
        type=float,
        nargs="+",
        default=[60.0],
        help="replica start-up seconds; several values sweep (e.g. 30 60 120 300)",
    )
    ap.add_argument("--slo-s", type=float, default=1.0, help="TTFT SLO")
    ap.add_argument("--preset", default="h100-llama3-8b", help="batcher.simulated preset of the replicas")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, help="mean prompt (default: the trace's mean, else 512)")
    ap.add_argument("--output-tokens", type=int, help="mean answer (default: the trace's mean, else the preset's)")
    ap.add_argument(
        "--target-running", type=float, help="serve_default's target_ongoing_requests (default 0.75 x max-num-seqs)"
    )
    ap.add_argument("--max-replicas", type=int, default=1000)
    ap.add_argument("--clairvoyant-fill", type=float, default=0.9, help="clairvoyant's share of a replica's limits")
    ap.add_argument("--dt-s", type=float, default=0.25, help="simulation tick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/autoscaling", help="directory for JSON and PNGs")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    trace, tokens = load_trace(args.trace, args.rate_scale, args.window_s, args.peak_rps, args.hours)
    prompt = args.prompt_tokens or round(tokens.get("input_tokens", 512))
    output = args.output_tokens or (round(tokens["output_tokens"]) if tokens else None)
    work = SimWorkload(args.preset, args.max_num_seqs, prompt_tokens=prompt, output_tokens=output)
    target_running = args.target_running or 0.75 * args.max_num_seqs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "trace": trace.name,
        "duration_s": trace.duration_s,
        "rate_scale": args.rate_scale,
        "window_s": args.window_s,
        "preset": args.preset,
        "max_num_seqs": args.max_num_seqs,
        "prompt_tokens": prompt,
        "output_tokens": work.mean_output,
        "tokens_from_trace": bool(tokens) and not (args.prompt_tokens and args.output_tokens),
        "target_running": target_running,
        "slo_s": args.slo_s,
        "replica_rps_clairvoyant": work.capacity_rps(args.clairvoyant_fill),
        "replica_rps_full": work.capacity_rps(),
        "runs": [],
    }
    if tokens:
        print(
            f"tokens per request: {prompt} in, {work.mean_output} out"
            + (" (the trace's means)" if report["tokens_from_trace"] else "")
        )
    print(
        f"trace {trace.name}: {trace.duration_s / 3600:.2f} h, peak {trace.rate_rps.max():.0f} req/s, mean "
        f"{np.mean(trace.rate(np.arange(0, trace.duration_s, 1.0))):.1f}; replica ({args.preset}, "
        f"{args.max_num_seqs} seqs): {report['replica_rps_full']:.1f} req/s full, "
        f"{report['replica_rps_clairvoyant']:.1f} at the clairvoyant's fill (simulated)"
    )
    for startup in args.startup_s:
        t0 = time.time()
        results = run_all(
            trace,
            work,
            startup,
            args.slo_s,
            args.max_replicas,
            target_running,
            args.dt_s,
            args.seed,
            args.clairvoyant_fill,
        )
        s = {name: summary(r, trace, args.slo_s) for name, r in results.items()}
        q = s["queue_depth"]
        s["fixed"], results["fixed"] = fixed_baseline(
            trace,
            work,
            startup,
            args.slo_s,
            args.dt_s,
            args.seed,
            q["replica_seconds"],
            q["slo_share"],
            args.max_replicas,
        )
        checks = check_targets(s)
        ahead = trace.lookahead_correlation(startup)
        print(
            table(startup, s) + f"\n({time.time() - t0:.0f} s to simulate; the rate one start-up ahead "
            f"against now: correlation {ahead:.2f})"
        )
        for c in checks:
            print(f"  {c['target']:<40} {c['value']:>8.3f}  (target {c['bound']})  {'met' if c['met'] else 'MISSED'}")
        run = {"startup_s": startup, "rate_correlation_one_startup_ahead": ahead, "policies": s, "targets": checks}
        if not args.no_plot:
            from cluster.plots import plot_run

            run["plots"] = [
                str(plot_run(results[n], trace, out / f"{n}_startup{startup:.0f}.png", startup)) for n in results
            ]
        report["runs"].append(run)
    path = out / "simulate.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
