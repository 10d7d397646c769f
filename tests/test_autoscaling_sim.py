"""The fleet simulator (no Ray cluster): the policies as Serve's controller runs them, on a short
trace: steady load, then a 3x burst that holds, then back; the CLI on a rate trace and on a request
trace. About 30 s."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster import simulate
from cluster.fleet_sim_parts import SimWorkload
from cluster.traces import Trace, day_trace, load_csv, write_csv
from deployments.autoscaling import DOWN_HEADROOM

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
    results = simulate.run_all(trace, work, STARTUP_S, slo_s=1.0, max_replicas=200, target_running=96, dt_s=0.5, seed=1)
    return {n: (r, simulate.summary(r, trace, 1.0)) for n, r in results.items()}


def test_every_request_is_served(runs):
    for name, (_res, s) in runs.items():
        assert s["unserved_at_end"] == 0 and abs(s["served"] - s["requests"]) <= 1, name


def test_a_burst_is_sized_for_its_rate_and_backlog_not_its_queue_as_load(runs, trace):
    res, _ = runs["queue_depth"]
    t, target = np.array(res.t), np.array(res.target)
    work = SimWorkload()
    full = work.throughput_rps(work.max_num_seqs)
    need = 600 / full  # replicas that keep up with 600 req/s, full
    # While the first new replicas start (600 s .. 660 s) the replicas sized for 200 req/s serve what
    # they can and the rest queues: the burst asks for the rate plus draining, within one start-up,
    # the queue there is (at most a start-up of the excess), and no more: counting the queue as load
    # at 128 per replica would ask for hundreds.
    backlog = (600 - 200) * STARTUP_S
    with_backlog = (600 + backlog / STARTUP_S) / full
    starting = target[(t >= 600) & (t < 600 + STARTUP_S)]
    assert 1.2 * need <= starting.max() <= 1.2 * with_backlog
    # The drain's level is kept a start-up after it was last needed (rent or buy), then the fleet
    # settles near the need, within the room going down keeps for a rise (DOWN_HEADROOM). A drain into
    # a rate that holds is not a burst: not kept YOUNG_HOLD start-ups though the memory is young.
    drained = t[(t >= 600) & (target == target.max())].max()
    held = target[(t > drained) & (t < drained + 0.9 * STARTUP_S)]
    assert held.min() > DOWN_HEADROOM * need + 2, held
    settled = target[(t >= drained + 2 * STARTUP_S) & (t < 1200)]
    assert settled.size
    assert need <= settled.min() and settled.max() <= DOWN_HEADROOM * need + 2


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
    assert report["duration_s"] == pytest.approx(900, abs=1) and not report["tokens_from_trace"]
    (run,) = report["runs"]
    # How much the rate now says of the rate one start-up ahead (the bound on any online policy).
    assert run["rate_correlation_one_startup_ahead"] == pytest.approx(load_csv(str(path)).lookahead_correlation(30.0))
    pol = run["policies"]
    q, d, c, f = pol["queue_depth"], pol["serve_default"], pol["clairvoyant"], pol["fixed"]
    # One trace, one seed: every policy got the same requests, and served them all.
    sims = [q, d, c]
    assert len({p["requests"] for p in sims}) == 1
    assert all(p["served"] == p["requests"] and p["unserved_at_end"] == 0 for p in sims), pol
    # The bound costs least, and Serve's delays cost the most.
    assert c["replica_seconds"] <= q["replica_seconds"] < d["replica_seconds"]
    # The fixed fleet has queue_depth's replica-seconds; its share lies between the whole counts
    # around them; the count that matches queue_depth's share reaches it and one fewer does not.
    assert f["replica_seconds"] == q["replica_seconds"]
    by_count = {int(n): v for n, v in f["slo_share_by_count"].items()}
    lo = int(f["replicas"])
    assert min(by_count[lo], by_count[lo + 1]) <= f["slo_share"] <= max(by_count[lo], by_count[lo + 1])
    m = f["replicas_to_match_queue_depth"]
    assert by_count[m] >= q["slo_share"] and (m == 1 or by_count[m - 1] < q["slo_share"])
    # Each target is computed from these figures, and its verdict from its value.
    checks = {t["target"]: t for t in run["targets"]}
    slo = checks["slo_share - serve_default's"]
    assert slo["value"] == pytest.approx(q["slo_share"] - d["slo_share"])
    assert slo["met"] == (slo["value"] >= simulate.TARGETS["slo_points_over_serve"])
    cost = checks["replica-seconds / serve_default's"]
    assert cost["value"] == pytest.approx(q["replica_seconds"] / d["replica_seconds"]) and cost["met"]
    fixed = checks["slo_share - fixed fleet's (equal r-s)"]
    assert fixed["value"] == pytest.approx(q["slo_share"] - f["slo_share"]) and fixed["met"] == (fixed["value"] > 0)
    rev = checks["reversals - clairvoyant's"]
    assert rev["value"] == q["reversals"] - c["reversals"] and rev["met"] == (rev["value"] <= 0)
    # One plot per policy, named after it.
    assert [Path(p).name for p in run["plots"]] == [f"{name}_startup30.png" for name in pol]


def test_cli_replays_a_request_trace_with_its_tokens_scaled_and_windowed(tmp_path):
    # Azure's layout: an ISO timestamp, prompt and answer tokens; 10 min of 20 s bursts every 2 min.
    rng = np.random.default_rng(0)
    t = np.concatenate([b + rng.uniform(0, 20, 300) for b in range(0, 600, 120)])
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [
        f"2023-11-16 18:{int(x // 60):02d}:{x % 60:09.6f},{700 + i % 200},{100 + i % 50}"
        for i, x in enumerate(np.sort(t))
    ]
    path = tmp_path / "bursts.csv"
    path.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    assert (
        simulate.main(
            [
                "--trace",
                str(path),
                "--rate-scale",
                "4",
                "--window-s",
                "0",
                "480",
                "--startup-s",
                "30",
                "--out",
                str(out),
                "--dt-s",
                "0.5",
                "--no-plot",
            ]
        )
        == 0
    )
    report = json.loads((out / "simulate.json").read_text())
    # The trace's mean tokens were used (no --prompt-tokens / --output-tokens), the window cut it.
    assert report["tokens_from_trace"] and report["prompt_tokens"] == 800 and report["output_tokens"] == 124
    assert report["duration_s"] <= 480
    pol = report["runs"][0]["policies"]
    # 4 x 1200 requests in 4 bursts in the window, binned to 10 s: 15 req/s per burst x 4.
    assert pol["queue_depth"]["requests"] == pytest.approx(4 * 4 * 300, rel=0.1)
    assert {"queue_depth", "serve_default", "clairvoyant", "fixed"} <= set(pol)
    assert all("reversals" in p for n, p in pol.items() if n != "fixed")


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


def test_the_learned_bound_follows_the_policy_then_holds_a_constant_fleet(runs, trace):
    """cluster.breakdown's learned bound: queue_depth's fleet until `after`, then a constant count;
    the fewest such replicas reaching queue_depth's SLO share, and the share at Serve default's budget."""
    from cluster.breakdown import learned_bound, learned_summary

    work, after = SimWorkload(), 900.0
    q, d = runs["queue_depth"][0], runs["serve_default"][0]
    held = learned_bound(trace, work, STARTUP_S, 1.0, 0.5, 1, q, after, 3)
    n = min(len(held.t), len(q.t))
    t, target = np.array(held.t[:n]), np.array(held.target[:n])
    assert np.array_equal(target[t < after], np.array(q.target[:n])[t < after])
    assert set(target[t >= after]) == {3}
    s = learned_summary(trace, work, STARTUP_S, 1.0, 0.5, 1, q, d, after)
    by_count = s["by_count"]
    shares = [by_count[c]["slo_share"] for c in sorted(by_count)]
    assert shares == sorted(shares)  # more replicas after `after`: no fewer requests within the SLO
    q_share, match = q.within_slo / q.requests, s["replicas_to_match_share"]
    assert match > 1 and by_count[match]["slo_share"] >= q_share - 1e-9 and by_count[match - 1]["slo_share"] < q_share
    costs = [by_count[c]["replica_seconds"] for c in sorted(by_count)]
    assert costs == sorted(costs) and costs[-1] > d.replica_seconds  # the search went past the budget
    assert s["slo_share_at_budget"] is not None
