"""`python -m cluster.breakdown`: where a policy's SLO misses and extra replica-seconds come from, and
what any purely reactive policy could achieve on the same trace.

Phases, per second of the trace (the start-up time W is the horizon a reactive policy cannot see past):
- rise: the rate grew more than `--band` (10%) within the last W seconds: the fleet asked for a
  start-up ago is too small by construction;
- fall: the rate dropped more than the band within the last W seconds;
- steady: the rest.
A missed request is counted in the phase of its arrival second; a replica-second over the
clairvoyant's in the phase where it was billed.

Reactive bound: a schedule that knows the current rate exactly (no forecast, no metric lag, no
queue) and asks for `headroom` x the replicas that rate fills completely (1.33: 75% full, as
the policy's target_running); replicas
still take the start-up time to come. No reactive policy does better at that headroom, so the
headroom that reaches the SLO target says what the target costs without foresight.

Learned bound (`--learned-after-s T`): queue_depth's own fleet until T, then a constant count
chosen with the trace in hand. Where the rate a start-up ahead is uncorrelated with the rate now (the
bursty traces), a constant fleet is what an online policy can at best approach once it has learned
the traffic (docs/autoscaling.md), so this says how much of queue_depth's cost after T is its own,
and what Serve default's replica-seconds could buy at best after the same first T seconds.

Every figure is a simulation (cluster.fleet_sim).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict

import numpy as np

from cluster.fleet_sim import FleetSim
from cluster.fleet_sim_parts import Result, SimWorkload
from cluster.simulate import fewest, load_trace, run_all
from cluster.traces import Trace

PHASES = ("rise", "steady", "fall")


def phases(trace: Trace, startup_s: float, band: float = 0.1) -> np.ndarray:
    """The phase index (into PHASES) of every second of the trace."""
    t = np.arange(int(trace.duration_s) + 2, dtype=float)
    now, before = trace.rate(t), trace.rate(np.maximum(0.0, t - startup_s))
    # Highest and lowest rate over the last W seconds: a rise that then holds is still a rise until
    # a whole start-up time has passed.
    lo = np.array([trace.rate(np.linspace(max(0.0, x - startup_s), x, 7)).min() for x in t])
    hi = np.array([trace.rate(np.linspace(max(0.0, x - startup_s), x, 7)).max() for x in t])
    out = np.full(len(t), PHASES.index("steady"))
    out[now > (1 + band) * np.maximum(lo, 1e-9)] = PHASES.index("rise")
    out[(now < (1 - band) * hi) & (now <= before)] = PHASES.index("fall")
    return out


def attribute(res: Result, clairvoyant: Result, phase: np.ndarray) -> Dict[str, dict]:
    """SLO misses and replica-seconds over the clairvoyant's, per phase."""
    t = np.asarray(res.t, dtype=int)
    extra = np.asarray(res.replicas, float) - np.asarray(clairvoyant.replicas, float)[: len(t)]
    period = res.t[1] - res.t[0] if len(res.t) > 1 else 1.0
    out = {}
    for i, name in enumerate(PHASES):
        here = phase[: len(res.arrived)] == i
        out[name] = {
            "seconds": int(here.sum()),
            "requests": round(float(res.arrived[here].sum())),
            "missed": round(float(res.missed[here].sum())),
            "missed_share_of_all": float(res.missed[here].sum() / max(res.requests, 1e-9)),
            "extra_replica_seconds": round(float(extra[phase[t] == i].sum() * period)),
        }
    return out


def reactive_bound(
    trace: Trace,
    work: SimWorkload,
    startup_s: float,
    headroom: float,
    slo_s: float,
    dt_s: float,
    seed: int,
    max_replicas: int = 1000,
) -> Result:
    per_replica = work.capacity_rps()  # full replicas (slots or prefill budget): headroom 1.33 = 75% full

    def schedule(t: float) -> int:
        return max(1, min(max_replicas, math.ceil(headroom * trace.rate(t) / per_replica)))

    sim = FleetSim(trace, work, startup_s, dt_s=dt_s, slo_s=slo_s, seed=seed)
    return sim.run(schedule=schedule, initial=schedule(0.0), name=f"reactive x{headroom:g}")


def learned_bound(
    trace: Trace,
    work: SimWorkload,
    startup_s: float,
    slo_s: float,
    dt_s: float,
    seed: int,
    policy: Result,
    after_s: float,
    count: int,
) -> Result:
    """`policy`'s fleet (its target at each tick) until `after_s`, then `count` replicas."""
    t, target = np.asarray(policy.t), np.asarray(policy.target)

    def schedule(now: float) -> int:
        if now >= after_s:
            return count
        return int(target[max(0, np.searchsorted(t, now, side="right") - 1)])

    sim = FleetSim(trace, work, startup_s, dt_s=dt_s, slo_s=slo_s, seed=seed)
    return sim.run(schedule=schedule, initial=policy.replicas[0], name=f"learned then {count}")


def learned_summary(
    trace: Trace,
    work: SimWorkload,
    startup_s: float,
    slo_s: float,
    dt_s: float,
    seed: int,
    policy: Result,
    budget: Result,
    after_s: float,
    max_replicas: int = 1000,
) -> dict:
    """The learned bound at `policy`'s SLO share (the fewest replicas after `after_s` reaching it) and
    at `budget`'s replica-seconds (SLO share interpolated between the counts around them). Both grow
    with the count (simulate.fewest)."""
    runs: Dict[int, Result] = {}

    def run(n: int) -> Result:
        if n not in runs:
            runs[n] = learned_bound(trace, work, startup_s, slo_s, dt_s, seed, policy, after_s, n)
        return runs[n]

    target = _share(policy) - 1e-9
    match = fewest(lambda n: _share(run(n)) >= target, max_replicas)
    over = fewest(lambda n: run(n).replica_seconds > budget.replica_seconds, max_replicas)
    at_budget = None
    if over is not None and over > 1:
        lo, hi = run(over - 1), run(over)
        f = (budget.replica_seconds - lo.replica_seconds) / (hi.replica_seconds - lo.replica_seconds)
        at_budget = _share(lo) + f * (_share(hi) - _share(lo))
    return {
        "after_s": after_s,
        "replicas_to_match_share": match,
        "replica_seconds_to_match_share": round(runs[match].replica_seconds) if match else None,
        "slo_share_at_budget": at_budget,
        "by_count": {
            n: {"replica_seconds": round(r.replica_seconds), "slo_share": _share(r)} for n, r in sorted(runs.items())
        },
    }


def _share(res: Result) -> float:
    return res.within_slo / max(res.requests, 1e-9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="rate CSV, request trace or bundled trace name (default: the built-in day, 4 h)")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply the trace's rate")
    ap.add_argument("--peak-rps", type=float, default=3000.0)
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--startup-s", type=float, default=60.0)
    ap.add_argument("--slo-s", type=float, default=1.0)
    ap.add_argument(
        "--headroom",
        type=float,
        nargs="*",
        default=[1.0, 1.33, 2.0],
        help="standing headroom of the reactive bound (none: skip it)",
    )
    ap.add_argument("--band", type=float, default=0.1, help="rate change within a start-up that makes a rise/fall")
    ap.add_argument(
        "--learned-after-s",
        type=float,
        default=900.0,
        help="the learned bound: queue_depth until then, a constant fleet after (0: skip it)",
    )
    ap.add_argument("--preset", default="h100-llama3-8b", help="batcher.simulated preset of the replicas")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--dt-s", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/autoscaling/breakdown.json")
    args = ap.parse_args(argv)

    trace, tokens = load_trace(args.trace, args.rate_scale, peak_rps=args.peak_rps, hours=args.hours)
    work = SimWorkload(
        args.preset,
        args.max_num_seqs,
        prompt_tokens=round(tokens.get("input_tokens", 512)),
        output_tokens=round(tokens["output_tokens"]) if tokens else None,
    )
    runs = run_all(
        trace,
        work,
        args.startup_s,
        args.slo_s,
        1000,
        0.75 * args.max_num_seqs,
        args.dt_s,
        args.seed,
        names=("queue_depth", "serve_default"),
    )
    clair = runs["clairvoyant"]
    for h in args.headroom:
        runs[f"reactive x{h:g}"] = reactive_bound(trace, work, args.startup_s, h, args.slo_s, args.dt_s, args.seed)
    phase = phases(trace, args.startup_s, args.band)
    report = {"trace": trace.name, "startup_s": args.startup_s, "slo_s": args.slo_s, "policies": {}}
    print(
        f"start-up {args.startup_s:.0f} s, SLO {args.slo_s} s; phases (s): "
        + ", ".join(f"{p} {int((phase == i).sum())}" for i, p in enumerate(PHASES))
    )
    print(
        f"{'policy':<14} {'x clairv':>8} {'in SLO':>7}  "
        + "  ".join(f"{p + ' missed / extra r-s':>28}" for p in PHASES)
    )
    for name, res in runs.items():
        parts = attribute(res, clair, phase)
        x = res.replica_seconds / clair.replica_seconds
        share = res.within_slo / max(res.requests, 1e-9)
        report["policies"][name] = {"x_clairvoyant": x, "slo_share": share, "phases": parts}
        print(
            f"{name:<14} {x:>8.2f} {share:>7.2%}  "
            + "  ".join(
                f"{parts[p]['missed_share_of_all']:>13.2%} / {parts[p]['extra_replica_seconds']:>10}" for p in PHASES
            )
        )
    if args.learned_after_s > 0:
        q, d = runs["queue_depth"], runs["serve_default"]
        bound = learned_summary(
            trace, work, args.startup_s, args.slo_s, args.dt_s, args.seed, q, d, args.learned_after_s
        )
        report["learned_bound"] = bound
        n, rs, at = (
            bound["replicas_to_match_share"],
            bound["replica_seconds_to_match_share"],
            bound["slo_share_at_budget"],
        )
        print(
            f"learned bound: queue_depth until {args.learned_after_s:.0f} s, then a constant fleet chosen with the trace in hand"
        )
        print(
            f"  at queue_depth's SLO share ({_share(q):.2%}): {n} replicas, {rs} replica-s "
            f"({rs / q.replica_seconds:.2f}x queue_depth's, {rs / d.replica_seconds:.2f}x serve_default's)"
            if n
            else "  no constant fleet reaches queue_depth's SLO share"
        )
        if at is not None:
            print(
                f"  at serve_default's replica-seconds ({d.replica_seconds:.0f}): {at:.2%} within the SLO "
                f"({100 * (at - _share(d)):+.1f} points over serve_default's {_share(d):.2%})"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
