"""The fleet simulator (no Ray cluster): the policies as Serve's controller runs them, on a short
trace: steady load, then a 3x burst that holds, then back. About 20 s."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster import simulate
from cluster.fleet_sim import SimWorkload
from cluster.traces import Trace, day_trace, load_csv, write_csv

STARTUP_S = 60.0


@pytest.fixture(scope="module")
def trace():
    # 10 min at 200 req/s, a 3x step within 10 s held 10 min, back to 200 for 20 min.
    t = np.array([0, 600, 610, 1200, 1210, 2400.0])
    rate = np.array([200, 200, 600, 600, 200, 200.0])
    # Steady spans start once the fleet has settled from the run's start (its first minutes size it).
    return Trace(t, rate, "step", steady=[(300.0, 600.0), (1800.0, 2400.0)])


@pytest.fixture(scope="module")
def runs(trace):
    work = SimWorkload()
    results = simulate.run_all(trace, work, STARTUP_S, slo_s=1.0, max_replicas=200, target_running=96,
                               dt_s=0.5, seed=1)
    return {n: (r, simulate.summary(r, trace, 1.0)) for n, r in results.items()}


def test_every_request_is_served(runs):
    for name, (res, s) in runs.items():
        assert s["unserved_at_end"] == 0 and abs(s["served"] - s["requests"]) <= 1, name


def test_burst_jumps_to_the_needed_count_in_one_decision(runs, trace):
    res, _ = runs["queue_depth"]
    t, target = np.array(res.t), np.array(res.target)
    assert np.diff(target).max() >= 5  # not one replica per tick
    work = SimWorkload()
    need = 600 / work.throughput_rps(96)  # replicas at target_running for 600 req/s
    # While the first new replicas start (600 s .. 660 s) the 11 replicas sized for 200 req/s serve
    # what they can at full speed and the rest queues: the burst asks for the rate plus draining that
    # backlog within queue_drain_s (30 s) once they land, and no more (the queue growing every tick
    # while they start is the same backlog, not a new one).
    backlog = (600 - 11 * work.throughput_rps(work.max_num_seqs)) * STARTUP_S
    with_backlog = (600 + backlog / 30.0) / work.throughput_rps(96)
    starting = target[(t >= 600) & (t < 600 + STARTUP_S)]
    assert 1.5 * need <= starting.max() <= 1.3 * with_backlog


def test_serves_delay_logic_runs_on_the_simulated_clock(runs):
    res, _ = runs["serve_default"]
    t, target = np.array(res.t), np.array(res.target)
    before = target[t < 600].max()
    first_up = t[(t >= 600) & (target > before)].min()
    assert first_up >= 600 + 30  # Serve's own 30 s upscale delay, after the burst at 600 s
    # ...and its 600 s downscale delay: no decrease within 600 s of reaching the peak.
    peak_at = t[target == target.max()].min()
    first_down = t[(t > peak_at) & (target < target.max())].min()
    assert first_down - peak_at >= 600


def test_queue_depth_costs_less_than_serve_default_and_stays_above_the_bound(runs):
    q, d, c = (runs[n][1] for n in ("queue_depth", "serve_default", "clairvoyant"))
    assert q["replica_seconds"] < 0.85 * d["replica_seconds"]
    assert c["replica_seconds"] <= q["replica_seconds"]
    assert q["ttft_p99_s"] <= d["ttft_p99_s"]


def test_no_oscillation_in_steady_load(runs):
    assert runs["queue_depth"][1]["reversals_steady"] == 0


def test_cli_report_figures_agree_with_each_other(tmp_path):
    path = tmp_path / "trace.csv"
    write_csv(day_trace(peak_rps=60, hours=0.25), str(path))
    assert load_csv(str(path)).duration_s == pytest.approx(900, abs=1)
    out = tmp_path / "out"
    assert simulate.main(["--trace", str(path), "--startup-s", "30", "--out", str(out), "--dt-s", "0.5"]) == 0
    report = json.loads((out / "simulate.json").read_text())
    assert report["duration_s"] == pytest.approx(900, abs=1)
    (run,) = report["runs"]
    pol = run["policies"]
    q, d, c = pol["queue_depth"], pol["serve_default"], pol["clairvoyant"]
    # One trace, one seed: every policy got the same requests, and served them all.
    assert len({p["requests"] for p in pol.values()}) == 1
    assert all(p["served"] == p["requests"] and p["unserved_at_end"] == 0 for p in pol.values()), pol
    # The bound costs least, and Serve's delays cost the most.
    assert c["replica_seconds"] <= q["replica_seconds"] < d["replica_seconds"]
    # Each target is computed from these figures, and its verdict from its value.
    checks = {t["target"].strip(): t for t in run["targets"]}
    saving = checks["replica-seconds saved vs serve_default"]
    assert saving["value"] == pytest.approx(1 - q["replica_seconds"] / d["replica_seconds"])
    assert saving["met"] == (saving["value"] >= simulate.TARGETS["saving_vs_serve"])
    ratio = checks["replica-seconds / clairvoyant"]
    assert ratio["value"] == pytest.approx(q["replica_seconds"] / c["replica_seconds"])
    assert ratio["met"] == (ratio["value"] <= simulate.TARGETS["x_clairvoyant"])
    slo = checks["queue_depth slo_share"]
    assert slo["value"] == q["slo_share"] and slo["met"] == (q["slo_share"] >= simulate.TARGETS["slo_share"])
    ttft = checks["... at p99 TTFT <= serve_default's"]
    assert ttft["value"] == q["ttft_p99_s"] and ttft["met"] == (q["ttft_p99_s"] <= d["ttft_p99_s"])
    # One plot per policy, named after it.
    assert [Path(p).name for p in run["plots"]] == [f"{name}_startup30.png" for name in pol]


def test_breakdown_phases_and_attribution(runs, trace):
    from cluster.breakdown import PHASES, attribute, phases

    phase = phases(trace, STARTUP_S)
    named = lambda t: PHASES[phase[t]]  # noqa: E731
    assert named(300) == "steady" and named(630) == "rise" and named(1240) == "fall" and named(2000) == "steady"
    assert named(1100) == "steady"  # the burst held longer than a start-up: no longer a rise
    res, s = runs["queue_depth"]
    parts = attribute(res, runs["clairvoyant"][0], phase)
    missed = sum(p["missed"] for p in parts.values())
    assert missed == pytest.approx(res.requests - res.within_slo, abs=2)
    # Per second, a rise is where SLO misses come from (its backlog also spills into what follows).
    per_s = {p: parts[p]["missed"] / max(parts[p]["seconds"], 1) for p in PHASES}
    assert per_s["rise"] > 5 * per_s["steady"]


def test_reactive_bound_buys_slo_with_headroom(trace):
    from cluster.breakdown import reactive_bound

    work = SimWorkload()
    lean, wide = (reactive_bound(trace, work, STARTUP_S, h, slo_s=1.0, dt_s=0.5, seed=1) for h in (1.0, 2.0))
    assert wide.within_slo > lean.within_slo and wide.replica_seconds > 1.5 * lean.replica_seconds
