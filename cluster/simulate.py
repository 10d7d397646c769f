"""`python -m cluster.simulate`: replay a request-rate trace through a fleet of simulated replicas
under three autoscalers and compare them.

- queue_depth: deployments.autoscaling:QueueDepthPolicy, the function the deployment runs, with the
  config the app gives it (deployments.config.AutoscalingConfig.to_serve()).
- serve_default: Serve's replica_queue_length_autoscaling_policy with Serve's own defaults (30 s
  look-back, 10 s metric pushes, 30 s / 600 s delays), target_ongoing_requests = the same per-replica
  target; Serve's delay and smoothing code runs, not a copy of it.
- clairvoyant: knows the trace; runs the fewest replicas, each filled to `--clairvoyant-fill` of
  max_num_seqs (default 0.9: fuller and Poisson arrivals queue), that keep up with the highest rate
  of the next start-up period, asked for start-up seconds ahead; drops replicas as soon as the rate
  allows. The bound the targets compare against.

Every run starts with the fleet the clairvoyant has at t = 0 (all policies alike).

Every figure is a simulation (batcher.simulated's StepTimeModel for replica speed).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List

from ray.serve.config import AutoscalingConfig

from deployments.autoscaling import SERVE_POLICY_PATH, QueueDepthPolicy
from cluster.fleet_sim import FleetSim, Policy, Result, SimWorkload
from cluster.traces import Trace, day_trace, load_csv
from deployments.config import AutoscalingConfig as AppAutoscaling

TARGETS = {"slo_share": 0.99, "saving_vs_serve": 0.30, "x_clairvoyant": 1.2, "reversals_per_10min": 1.0}


def policies(work: SimWorkload, max_replicas: int, target_running: float, startup_s: float,
             growth_lead: float = 0.0) -> Dict[str, Policy]:
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    # The operator states the start-up time (the policy measures it after the first scale-up) and the
    # drain time follows it (the config requires queue_drain_s >= startup_s / 2).
    knobs = {"target_running": target_running, "startup_s": startup_s,
             "queue_drain_s": max(30.0, startup_s / 2), "growth_lead": growth_lead}
    ours = AppAutoscaling(min_replicas=1, max_replicas=max_replicas, policy_kwargs=knobs)
    serve = AppAutoscaling(min_replicas=1, max_replicas=max_replicas, policy=SERVE_POLICY_PATH,
                           target_ongoing_requests=target_running, metrics_interval_s=10.0)
    return {
        "queue_depth": Policy("queue_depth", QueueDepthPolicy(**ours.policy_kwargs),
                              AutoscalingConfig(**ours.to_serve())),
        "serve_default": Policy("serve_default", replica_queue_length_autoscaling_policy,
                                AutoscalingConfig(**serve.to_serve())),
    }


def clairvoyant_schedule(trace: Trace, work: SimWorkload, startup_s: float, max_replicas: int, fill: float):
    per_replica = work.throughput_rps(fill * work.max_num_seqs)

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
        "ttft_p50_s": res.ttft_quantile(0.50), "ttft_p99_s": res.ttft_quantile(0.99),
        "slo_s": slo_s, "slo_share": res.within_slo / max(res.requests, 1e-9),
        "requests": round(res.requests), "served": round(res.served), "unserved_at_end": round(res.unfinished),
        "reversals": reversals(res), "reversals_steady": reversals(res, trace.steady),
        "reversals_per_10min_steady": reversals(res, trace.steady) / (steady_min / 10) if steady_min else None,
        "peak_replicas": max(res.replicas),
    }


def run_all(trace: Trace, work: SimWorkload, startup_s: float, slo_s: float, max_replicas: int,
            target_running: float, dt_s: float, seed: int, fill: float = 0.9, growth_lead: float = 0.0,
            names=("queue_depth", "serve_default", "clairvoyant")) -> Dict[str, Result]:
    out = {}
    sched = clairvoyant_schedule(trace, work, startup_s, max_replicas, fill)
    for name, pol in policies(work, max_replicas, target_running, startup_s, growth_lead).items():
        if name not in names:
            continue
        out[name] = FleetSim(trace, work, startup_s, dt_s=dt_s, slo_s=slo_s, seed=seed).run(pol, initial=sched(0.0))
    out["clairvoyant"] = FleetSim(trace, work, startup_s, dt_s=dt_s, slo_s=slo_s, seed=seed).run(
        schedule=sched, initial=sched(0.0), name="clairvoyant")
    return out


def check_targets(s: Dict[str, dict]) -> List[dict]:
    q, d, c = s["queue_depth"], s["serve_default"], s["clairvoyant"]
    saving = 1 - q["replica_seconds"] / d["replica_seconds"]
    rows = [
        ("queue_depth slo_share", q["slo_share"], f">= {TARGETS['slo_share']:.0%}", q["slo_share"] >= TARGETS["slo_share"]),
        ("replica-seconds saved vs serve_default", saving, f">= {TARGETS['saving_vs_serve']:.0%}",
         saving >= TARGETS["saving_vs_serve"]),
        ("  ... at p99 TTFT <= serve_default's", q["ttft_p99_s"], f"<= {d['ttft_p99_s']:.3f} s",
         q["ttft_p99_s"] <= d["ttft_p99_s"]),
        ("replica-seconds / clairvoyant", q["replica_seconds"] / c["replica_seconds"],
         f"<= {TARGETS['x_clairvoyant']}", q["replica_seconds"] / c["replica_seconds"] <= TARGETS["x_clairvoyant"]),
        ("reversals per 10 min, steady load", q["reversals_per_10min_steady"], f"<= {TARGETS['reversals_per_10min']}",
         q["reversals_per_10min_steady"] is not None and q["reversals_per_10min_steady"] <= TARGETS["reversals_per_10min"]),
    ]
    return [{"target": n, "value": v, "bound": b, "met": bool(m)} for n, v, b, m in rows]


def table(startup_s: float, s: Dict[str, dict]) -> str:
    lines = [f"== start-up {startup_s:.0f} s",
             f"{'policy':<14} {'replica-s':>10} {'x clairv':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'in SLO':>7} {'reversals':>9} {'steady rev':>10} {'peak':>5}"]
    base = s["clairvoyant"]["replica_seconds"]
    for name, r in s.items():
        lines.append(f"{name:<14} {r['replica_seconds']:>10} {r['replica_seconds'] / base:>8.2f} "
                     f"{r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s {r['slo_share']:>7.2%} "
                     f"{r['reversals']:>9} {r['reversals_steady']:>10} {r['peak_replicas']:>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="CSV with columns t_s,rate_rps (default: the built-in day, 4 h)")
    ap.add_argument("--peak-rps", type=float, default=3000.0, help="peak rate of the built-in trace")
    ap.add_argument("--hours", type=float, default=4.0, help="length of the built-in day trace")
    ap.add_argument("--startup-s", type=float, nargs="+", default=[60.0],
                    help="replica start-up seconds; several values sweep (e.g. 30 60 120 300)")
    ap.add_argument("--slo-s", type=float, default=1.0, help="TTFT SLO")
    ap.add_argument("--preset", default="h100-llama3-8b", help="batcher.simulated preset of the replicas")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--target-running", type=float, help="per-replica target (default 0.75 x max-num-seqs)")
    ap.add_argument("--max-replicas", type=int, default=1000)
    ap.add_argument("--clairvoyant-fill", type=float, default=0.9, help="clairvoyant's running / max_num_seqs")
    ap.add_argument("--growth-lead", type=float, default=0.0,
                    help="queue_depth's growth_lead (extrapolate demand over this share of start-up; 0: off)")
    ap.add_argument("--dt-s", type=float, default=0.25, help="simulation tick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/autoscaling", help="directory for JSON and PNGs")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    trace = load_csv(args.trace) if args.trace else day_trace(args.peak_rps, args.hours)
    work = SimWorkload(args.preset, args.max_num_seqs, prompt_tokens=args.prompt_tokens)
    target_running = args.target_running or 0.75 * args.max_num_seqs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"trace": trace.name, "duration_s": trace.duration_s, "preset": args.preset,
              "max_num_seqs": args.max_num_seqs, "target_running": target_running, "slo_s": args.slo_s,
              "replica_rps_at_target": work.throughput_rps(target_running),
              "replica_rps_full": work.throughput_rps(args.max_num_seqs), "runs": []}
    print(f"trace {trace.name}: {trace.duration_s / 3600:.1f} h, peak {trace.rate_rps.max():.0f} req/s; "
          f"replica ({args.preset}, {args.max_num_seqs} seqs): {report['replica_rps_full']:.1f} req/s full, "
          f"{report['replica_rps_at_target']:.1f} at target {target_running:.0f} running (simulated)")
    for startup in args.startup_s:
        t0 = time.time()
        results = run_all(trace, work, startup, args.slo_s, args.max_replicas, target_running, args.dt_s, args.seed,
                          args.clairvoyant_fill, args.growth_lead)
        s = {name: summary(r, trace, args.slo_s) for name, r in results.items()}
        checks = check_targets(s)
        print(table(startup, s) + f"\n({time.time() - t0:.0f} s to simulate)")
        for c in checks:
            value = "n/a" if c["value"] is None else f"{c['value']:.3f}"
            print(f"  {c['target']:<42} {value:>8}  (target {c['bound']})  {'met' if c['met'] else 'MISSED'}")
        run = {"startup_s": startup, "policies": s, "targets": checks}
        if not args.no_plot:
            from cluster.plots import plot_run

            run["plots"] = [str(plot_run(results[n], trace, out / f"{n}_startup{startup:.0f}.png", startup))
                            for n in results]
        report["runs"].append(run)
    path = out / "simulate.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
