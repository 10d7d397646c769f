"""`python -m cluster.sim_check`: is the fleet simulator to be trusted? One short bursty trace (a window
of Azure's 2023 code-completion trace, time- and rate-scaled) replayed twice with the same autoscaling
policy, start-up and SLO:

- real: a local Serve app of simulated replicas (`sim:<preset>`: the real engine, scheduler, Serve
  handles, controller and policy; only the forward sleeps), driven over HTTP (streaming completions)
  at the trace's arrival times, after one request; the replica states are sampled every 0.5 s
  and every request's TTFT recorded. Each replica's start-up (ask to running) is measured from those
  samples;
- simulated: cluster.fleet_sim.FleetSim with the same arrival times, the app's policy and Serve
  config, those start-ups (replayed in turn) and the measured prompt length.
Both runs wrap the policy in RecordingPolicy: what it saw (requests in the system, queued at the
handles, running) and decided, per control tick, is printed beside the replica counts.

Agreement (the stated tolerance): running replicas within +-1 for >= 80% of the seconds, and the
share of requests within the TTFT SLO within 5 points. Prints both series side by side, writes JSON
and a PNG. Starts Ray (take the lock: `flock /tmp/iterserve-ray.lock .venv/bin/python -m
cluster.sim_check`) and stops it, on an error too.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from cluster.burst import app_config, full_step_s, serve_replay, startup_from
from cluster.fleet_sim import FleetSim
from cluster.fleet_sim_parts import Policy, SimWorkload
from cluster.plots import plot_sim_check
from cluster.request_traces import RequestTrace, bundled, load_request_trace
from cluster.traces import Trace

REPLICAS_TOLERANCE, REPLICAS_SHARE, SLO_POINTS = 1, 0.80, 0.05
AUTOSCALING_FIELDS = (
    "min_replicas",
    "max_replicas",
    "initial_replicas",
    "target_ongoing_requests",
    "metrics_interval_s",
    "look_back_period_s",
    "upscale_delay_s",
    "downscale_delay_s",
    "downscale_to_zero_delay_s",
    "upscaling_factor",
    "downscaling_factor",
)
FILLER = " Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Run:
    """One replay on a 1 s grid: running (serving) replicas and all asked for (starting + running)."""

    name: str
    t: np.ndarray
    running: np.ndarray
    asked: np.ndarray
    requests: int
    within_slo: float  # share of requests whose first token came within the SLO (failed ones miss)
    replica_seconds: float  # billed: starting, running and stopping replicas, integrated over time
    seen: dict = field(default_factory=dict)  # the policy's inputs on the grid (read_records)
    extra: dict = field(default_factory=dict)


def check_trace(window=(560.0, 1000.0), speedup: float = 2.0, rate: float = 0.12, seed: int = 0) -> RequestTrace:
    """Two bursts with a lull between (and a sustained stretch): minutes of the code trace in ~4."""
    return load_request_trace(bundled("azure_code_2023")).window(*window).time_scaled(speedup).rate_scaled(rate, seed)


def step_at(t_s, values, grid) -> np.ndarray:
    """The last value at or before each grid time (values hold between samples)."""
    idx = np.searchsorted(np.asarray(t_s), grid, side="right") - 1
    return np.asarray(values, dtype=float)[np.clip(idx, 0, len(values) - 1)]


def compare(
    real: Run,
    sim: Run,
    tolerance: int = REPLICAS_TOLERANCE,
    share: float = REPLICAS_SHARE,
    slo_points: float = SLO_POINTS,
) -> dict:
    """Agreement of two runs on their common grid (the stated tolerance), as figures and verdicts."""
    n = min(len(real.t), len(sim.t))
    diff = np.abs(real.running[:n] - sim.running[:n])
    within = float(np.mean(diff <= tolerance))
    slo_gap = abs(real.within_slo - sim.within_slo)
    return {
        "seconds": n,
        "running_within_tolerance": within,
        "running_exact": float(np.mean(diff == 0)),
        "running_mean_abs_diff": float(diff.mean()),
        "slo_share_real": real.within_slo,
        "slo_share_sim": sim.within_slo,
        "slo_gap_points": slo_gap * 100,
        "replica_seconds_ratio": sim.replica_seconds / max(real.replica_seconds, 1e-9),
        "replicas_agree": within >= share,
        "slo_agrees": slo_gap <= slo_points,
        "agree": within >= share and slo_gap <= slo_points,
        "tolerance": f"running replicas within +-{tolerance} for >= {share:.0%} of the seconds; "
        f"share within the SLO within {slo_points * 100:.0f} points",
    }


def load_policy(path: str, kwargs: dict):
    """The policy Serve would load from `pkg.mod:name` (a class is instantiated with its kwargs)."""
    module, _, name = path.partition(":")
    obj = getattr(importlib.import_module(module), name)
    return obj(**kwargs) if isinstance(obj, type) else obj


class RecordingPolicy:
    """A policy with a record of what it saw and decided: one JSON line per call (wall-clock time,
    replicas, the handles' demand and queue, the replicas' running sum, its decision). The same
    wrapper runs in Serve's controller and in the simulator, so their inputs can be compared."""

    def __init__(self, inner: str, inner_kwargs: dict, record_to: str):
        self.inner, self.path = load_policy(inner, inner_kwargs), record_to

    def __call__(self, ctx):
        n, state = self.inner(ctx)
        metrics = ctx.aggregated_metrics or {}
        running, capacity = metrics.get("running", {}), [x for x in metrics.get("capacity", {}).values() if x > 0]
        line = {
            "t": ctx.current_time if ctx.current_time is not None else time.time(),
            "current": ctx.current_num_replicas,
            "target": ctx.target_num_replicas,
            "demand": ctx.total_num_requests,
            "queued": ctx.total_queued_requests,
            "running": float(sum(running.values())),
            "decision": n,
            "capacity": float(np.median(capacity)) if capacity else None,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return n, state


def recorded(app: dict, record_to: str) -> dict:
    """`app` with its policy wrapped in RecordingPolicy; Serve's settings spelled out (the app fills
    them in per policy path, and the wrapper's path is not the policy's)."""
    from deployments.config import AppConfig

    scaling = AppConfig(**app).autoscaling.to_serve()
    policy = scaling.pop("policy")
    wrapped = {k: v for k, v in scaling.items() if k in AUTOSCALING_FIELDS}
    wrapped.update(
        policy="cluster.sim_check:RecordingPolicy",
        policy_kwargs={
            "inner": policy["policy_function"],
            "inner_kwargs": policy["policy_kwargs"],
            "record_to": record_to,
        },
    )
    return {**app, "autoscaling": wrapped}


def read_records(path: str, t0: float, grid: np.ndarray) -> dict:
    """The policy's record on `grid` (seconds from t0): demand, queued and running as it saw them."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []
    rows = [r for r in rows if r["t"] >= t0] or [{"t": t0, "demand": 0.0, "queued": 0.0, "running": 0.0}]
    t = [r["t"] - t0 for r in rows]
    return {k: step_at(t, [r[k] or 0.0 for r in rows], grid) for k in ("demand", "queued", "running")}


def reported_capacity(path: str) -> Optional[float]:
    """The median over the run of the replicas' reported capacity (req/s full) as the policy saw it."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []
    seen = [r["capacity"] for r in rows if r.get("capacity")]
    return float(np.median(seen)) if seen else None


def simulate(
    trace: RequestTrace,
    app: dict,
    startup_s: float,
    prompt_tokens: float,
    max_tokens: int,
    slo_s: float,
    end_s: float,
    record_to: str,
    startups_s: Optional[List[float]] = None,
    step_scale: float = 1.0,
    dt_s: float = 0.1,
) -> Run:
    """FleetSim on the trace's exact arrivals with the app's policy, Serve config and engine limits;
    `startups_s`: per-replica start-ups measured on Serve, replayed in turn (else startup_s for all)."""
    from ray.serve.config import AutoscalingConfig as ServeAutoscaling

    from batcher.simulated import preset_for
    from deployments.config import AppConfig

    cfg = AppConfig(**app)
    scaling = cfg.autoscaling.to_serve()  # what Serve's controller gets: the policy and its kwargs too
    path, kwargs = scaling["policy"]["policy_function"], scaling["policy"]["policy_kwargs"]
    Path(record_to).unlink(missing_ok=True)
    policy = Policy(path.rpartition(":")[2], RecordingPolicy(path, kwargs, record_to), ServeAutoscaling(**scaling))
    work = SimWorkload(
        preset_for(cfg.engine.model).name,
        cfg.engine.max_num_seqs,
        cfg.engine.max_num_batched_tokens,
        prompt_tokens=max(1, round(prompt_tokens)),
        output_tokens=max_tokens,
        step_scale=step_scale,
    )
    rate = Trace(np.array([0.0, end_s]), np.zeros(2), trace.name)  # the arrivals are replayed exactly
    sim = FleetSim(
        rate,
        work,
        startup_s,
        dt_s=dt_s,
        slo_s=slo_s,
        control_period_s=dt_s,
        arrivals_s=trace.t_s,
        startups_s=startups_s,
    )
    res = sim.run(policy, initial=cfg.autoscaling.initial_replicas or cfg.autoscaling.min_replicas)
    grid = np.arange(0.0, end_s, 1.0)
    return Run(
        "simulated",
        grid,
        step_at(res.t, res.ready, grid),
        step_at(res.t, res.target, grid),
        int(res.requests),
        res.within_slo / max(res.requests, 1e-9),
        res.replica_seconds,
        read_records(record_to, 0.0, grid),
        {
            "startup_s": startup_s,
            "startups_s": startups_s,
            "step_scale": step_scale,
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.mean_output,
        },
    )


def serve_default_scaling(app: dict, max_replicas: int) -> dict:
    """Serve's own policy as cluster.simulate's serve_default runs it: Serve's defaults (30 s look-back,
    30 s / 600 s delays, 10 s metric pushes), target_ongoing_requests 0.75 x max_num_seqs."""
    from deployments.autoscaling import SERVE_POLICY_PATH

    return {
        "min_replicas": 1,
        "max_replicas": max_replicas,
        "policy": SERVE_POLICY_PATH,
        "target_ongoing_requests": 0.75 * app["engine"]["max_num_seqs"],
        "metrics_interval_s": 10.0,
    }


def step_scale_for(app: dict, measured_step_s: Optional[float], prompt_tokens: float, max_tokens: int) -> float:
    """Measured full-replica step over the preset's, for the same batch (1.0 when not measured)."""
    from batcher.simulated import preset_for

    if not measured_step_s:
        return 1.0
    seqs = app["engine"]["max_num_seqs"]
    model = preset_for(app["engine"]["model"]).step.step_seconds(0, seqs, seqs * (prompt_tokens + max_tokens / 2))
    return measured_step_s / model


def prompt(i: int) -> str:
    return f"request {i}:{FILLER}"


async def replay_on_serve(
    trace: RequestTrace, app: dict, max_tokens: int, slo_s: float, end_s: float, record_to: str
) -> Run:
    """The trace over HTTP on a local Serve (started and stopped here) running `app`, its policy's
    inputs recorded to `record_to`."""
    Path(record_to).unlink(missing_ok=True)
    got = await serve_replay(
        recorded(app, record_to), trace.t_s.tolist(), [prompt(i) for i in range(len(trace))], max_tokens, end_s
    )
    samples, reqs = got["samples"], got["requests"]
    t = np.array([s[0] for s in samples])
    running, asked = np.array([s[1] for s in samples]), np.array([s[1] + s[2] for s in samples])
    billed = asked + np.array([s[3] for s in samples])
    grid = np.arange(0.0, end_s, 1.0)
    ttft = np.array([r["ttft_s"] if r["ttft_s"] is not None and r["ok"] else np.inf for r in reqs])
    startup, seen, seen_delays = startup_from([(s[0], s[1], s[2]) for s in samples], default=float("nan"))
    tokens = [r["prompt_tokens"] for r in reqs if r.get("prompt_tokens")]
    return Run(
        "real",
        grid,
        step_at(t, running, grid),
        step_at(t, asked, grid),
        len(reqs),
        float(np.mean(ttft <= slo_s)),
        float(step_at(t, billed, grid).sum()),
        read_records(record_to, got["t0_wall"], grid),
        {
            "startup_s": startup,
            "startups_seen": seen,
            "startups": seen_delays,
            "warm_up_s": got["warm_up_s"],
            "prompt_tokens": float(np.mean(tokens)) if tokens else 0.0,
            "failed": sum(not r["ok"] for r in reqs),
            "ttft_p50_s": float(np.median(ttft)),
            "ttft_p90_s": float(np.quantile(ttft, 0.9)),
            "full_step_s": full_step_s(reqs, slo_s, max_tokens),
            "errors": sorted({r["error"] for r in reqs if r.get("error")}),
            "ttft_s": [round(float(x), 3) if np.isfinite(x) else None for x in ttft],
            "latency_s": [r.get("latency_s") for r in reqs],
        },
    )


def side_by_side(real: Run, sim: Run, rate: np.ndarray, every_s: int = 5) -> str:
    """Replicas (running / asked for) and what the policy saw (requests in the system / queued at the
    handles), real | simulated, every `every_s` seconds."""
    lines = [
        f"{'t (s)':>5} {'req/s':>5} | {'running':>7} {'asked':>5} {'demand':>6} {'queued':>6} | "
        f"{'running':>7} {'asked':>5} {'demand':>6} {'queued':>6}   (real | simulated)"
    ]
    for i in range(0, min(len(real.t), len(sim.t)), every_s):
        cols = [
            f"{r.running[i]:>7.0f} {r.asked[i]:>5.0f} {r.seen['demand'][i]:>6.1f} {r.seen['queued'][i]:>6.1f}"
            for r in (real, sim)
        ]
        lines.append(f"{real.t[i]:>5.0f} {rate[i]:>5.1f} | {cols[0]} | {cols[1]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, nargs=2, default=[560.0, 1000.0], help="seconds of azure_code_2023")
    ap.add_argument("--speedup", type=float, default=2.0, help="time scaling of the window")
    ap.add_argument("--rate", type=float, default=0.12, help="rate scaling (share of requests kept, < 1)")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (ignore_eos)")
    ap.add_argument("--slo-s", type=float, default=1.0, help="TTFT SLO")
    ap.add_argument("--tail-s", type=float, default=30.0, help="seconds recorded after the last arrival")
    ap.add_argument(
        "--startup-s",
        type=float,
        help="the simulator's start-up, one for all replicas (default: each replica's measured on Serve, in turn)",
    )
    ap.add_argument(
        "--policy",
        choices=("queue_depth", "serve_default"),
        default="queue_depth",
        help="the app's policy (default) or Serve's, configured as cluster.simulate's serve_default",
    )
    ap.add_argument("--out", default="results/sim_check")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    trace = check_trace(tuple(args.window), args.speedup, args.rate)
    end_s = trace.duration_s + args.tail_s
    app = app_config(args.max_replicas, args.slo_s)
    if args.policy == "serve_default":
        app["autoscaling"] = serve_default_scaling(app, args.max_replicas)
    print(
        f"trace: {len(trace)} requests over {trace.duration_s:.0f} s ({', '.join(trace.notes)}); "
        f"SLO {args.slo_s} s; replicas 1..{args.max_replicas} of {app['engine']['model']}",
        flush=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    real = asyncio.run(replay_on_serve(trace, app, args.max_tokens, args.slo_s, end_s, str(out / "policy_real.jsonl")))
    print(
        f"real Serve: {time.time() - t0:.0f} s; start-up measured {real.extra['startup_s']:.1f} s (median of "
        f"{real.extra['startups_seen']} replicas: {real.extra['startups']}); {real.extra['failed']} failed",
        flush=True,
    )
    startup = args.startup_s or real.extra["startup_s"]
    if not startup == startup:  # nan: no scale-up completed on Serve; the policy's configured value
        startup = app["autoscaling"].get("policy_kwargs", {}).get("startup_s", 10.0)
    startups = None if args.startup_s else real.extra["startups"]
    scale = step_scale_for(app, real.extra["full_step_s"], real.extra["prompt_tokens"], args.max_tokens)
    print(
        f"a full replica's step: {real.extra['full_step_s'] or float('nan'):.4f} s measured, "
        f"{scale:.2f}x the preset's (given to the simulator)"
    )
    sim = simulate(
        trace,
        app,
        startup,
        real.extra["prompt_tokens"],
        args.max_tokens,
        args.slo_s,
        end_s,
        str(out / "policy_sim.jsonl"),
        startups,
        scale,
    )
    capacity = {r: reported_capacity(str(out / f"policy_{r}.jsonl")) for r in ("real", "sim")}
    print(
        f"a replica's capacity as the replicas reported it (median, req/s full): real {capacity['real']}, "
        f"simulated {capacity['sim']} (the preset's at the measured step)"
    )
    rate = np.where(sim.t <= trace.duration_s, trace.to_rate(10.0).rate(sim.t), 0.0)
    verdict = compare(real, sim)
    print(side_by_side(real, sim, rate))
    print(
        f"share within the {args.slo_s} s TTFT SLO: real {real.within_slo:.1%}, simulated {sim.within_slo:.1%}; "
        f"replica-seconds real {real.replica_seconds:.0f}, simulated {sim.replica_seconds:.0f}"
    )
    print(
        f"running replicas within +-{REPLICAS_TOLERANCE}: {verdict['running_within_tolerance']:.0%} of the "
        f"seconds (exact {verdict['running_exact']:.0%}); {'AGREE' if verdict['agree'] else 'DISAGREE'} "
        f"({verdict['tolerance']})"
    )
    report = {
        "trace": trace.describe(),
        "app": app,
        "startup_s": startup,
        "verdict": verdict,
        "capacity_rps": capacity,
        "real": {k: v for k, v in vars(real).items() if k not in ("t", "running", "asked", "seen")},
        "sim": {k: v for k, v in vars(sim).items() if k not in ("t", "running", "asked", "seen")},
        "series": {
            "t": real.t.tolist(),
            **{
                f"{r.name}_{k}": v.tolist()
                for r in (real, sim)
                for k, v in [("running", r.running), ("asked", r.asked), *((f"seen_{k}", v) for k, v in r.seen.items())]
            },
        },
    }
    if not args.no_plot:
        report["plot"] = str(plot_sim_check(real, sim, rate, verdict, out / "sim_check.png"))
    (out / "sim_check.json").write_text(json.dumps(report, indent=1, default=float))
    print(f"wrote {out / 'sim_check.json'}")
    return 0 if verdict["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
