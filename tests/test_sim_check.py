"""The simulator check (cluster.sim_check) without Ray: the comparison, the start-up measured from
replica states, the policy record, and the simulator defects it found (cluster.fleet_sim). Seconds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batcher.simulated import PRESETS
from cluster import burst, sim_check
from cluster.burst import app_config
from cluster.fleet_sim import FleetSim
from cluster.fleet_sim_parts import Policy, SimWorkload
from cluster.traces import Trace
from deployments.config import AppConfig


def _run(name, running, within):
    running = np.asarray(running, dtype=float)
    return sim_check.Run(name, np.arange(len(running), dtype=float), running, running, 10, within, running.sum())


def test_comparison_states_its_tolerance_and_judges_both_figures():
    real = _run("real", [1, 1, 2, 4, 4, 4, 3, 1, 1, 1], 0.50)
    close = _run("sim", [1, 1, 1, 3, 4, 4, 4, 2, 1, 1], 0.53)  # within +-1 everywhere, 3 points
    v = sim_check.compare(real, close)
    assert v["running_within_tolerance"] == 1.0 and v["running_exact"] == 0.6 and v["agree"]
    off = _run("sim", [1, 1, 1, 1, 1, 4, 4, 4, 1, 1], 0.53)  # 3 of 10 seconds off by 2 or more
    v = sim_check.compare(real, off)
    assert v["running_within_tolerance"] == pytest.approx(0.7) and not v["replicas_agree"] and not v["agree"]
    v = sim_check.compare(real, _run("sim", real.running, 0.56))  # same counts, 6 points apart
    assert v["replicas_agree"] and not v["slo_agrees"] and not v["agree"]


def test_startup_is_measured_per_replica_from_ask_to_running():
    # (t, running, starting): 1 -> 4 asked at t=1; they land at 5, 6 and 8 (shared cores: one by one).
    samples = [(0, 1, 0), (1, 1, 3), (5, 2, 2), (6, 3, 1), (8, 4, 0), (20, 4, 0)]
    median, n, delays = burst.startup_from(samples, default=30.0)
    assert delays == [4, 5, 7] and n == 3 and median == 5
    # An ask withdrawn before its replica ran is no start-up; nothing measured -> the default.
    assert burst.startup_from([(0, 1, 0), (1, 1, 1), (2, 1, 0), (9, 1, 0)], default=30.0) == (30.0, 0, [])


def test_recorded_app_keeps_serves_settings_and_the_policys_kwargs(tmp_path):
    app = app_config(4)
    plain = AppConfig(**app).autoscaling.to_serve()
    wrapped = AppConfig(**sim_check.recorded(app, str(tmp_path / "r.jsonl"))).autoscaling.to_serve()
    inner = wrapped.pop("policy")["policy_kwargs"]
    assert inner["inner"] == plain.pop("policy")["policy_function"]
    assert inner["inner_kwargs"] == AppConfig(**app).autoscaling.to_serve()["policy"]["policy_kwargs"]
    assert wrapped == plain  # look-back, delays, factors: what the app gives its own policy path


def test_simulated_replay_takes_the_traces_arrivals_exactly(tmp_path):
    trace = sim_check.check_trace()
    record = tmp_path / "sim.jsonl"
    run = sim_check.simulate(
        trace,
        app_config(4),
        startup_s=15.0,
        prompt_tokens=22,
        max_tokens=32,
        slo_s=1.0,
        end_s=trace.duration_s + 30,
        record_to=str(record),
    )
    assert run.requests == len(trace)
    assert run.running.min() >= 1 and run.running.max() <= 4 and len(run.t) == len(run.seen["demand"])
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert rows and {"demand", "queued", "running", "decision"} <= set(rows[0])


def test_serves_default_is_checked_with_serves_settings(tmp_path):
    # `--policy serve_default`: Serve's own policy as cluster.simulate runs it (target 0.75 x 4
    # sequences, 10 s metric pushes, Serve's 30 s look-back and 30 s / 600 s delays), recorded alike.
    app = app_config(4)
    app["autoscaling"] = sim_check.serve_default_scaling(app, 4)
    wrapped = AppConfig(**sim_check.recorded(app, str(tmp_path / "r.jsonl"))).autoscaling.to_serve()
    assert wrapped["policy"]["policy_kwargs"]["inner"].endswith(":replica_queue_length_autoscaling_policy")
    assert (
        wrapped["target_ongoing_requests"],
        wrapped["metrics_interval_s"],
        wrapped["look_back_period_s"],
        wrapped["upscale_delay_s"],
        wrapped["downscale_delay_s"],
    ) == (3.0, 10.0, 30.0, 30.0, 600.0)
    trace = sim_check.check_trace()
    run = sim_check.simulate(
        trace,
        app,
        startup_s=10.0,
        prompt_tokens=22,
        max_tokens=32,
        slo_s=1.0,
        end_s=trace.duration_s + 30,
        record_to=str(tmp_path / "sim.jsonl"),
    )
    first = int(np.argmax(run.seen["queued"] > 0))  # the first burst's queue, as the policy saw it
    asked = int(np.argmax(run.asked > 1))
    assert run.requests == len(trace) and first > 0
    assert 30 <= asked - first <= 31  # Serve's upscale delay: more replicas asked for 30 s after
    assert run.asked.max() == 4 and run.asked[-1] == 4  # then up, and no scale-down within 600 s


def test_the_handles_requests_are_averaged_as_rays_controller_does():
    # Ray 2.60 merges the handles' series (queued, and running per replica) into change points before
    # averaging: a quiet start of the look-back has none, so a burst after a lull reads at its own
    # level (the sim check's real Serve saw 14 where a plain mean over the look-back said 3.6).
    from ray.serve._private.autoscaling_metrics_merge import merge_and_aggregate_arrays

    from cluster.fleet_sim_parts import serve_mean

    rng = np.random.default_rng(0)
    times = 1000.0 + 6.0 * np.arange(6)  # a 30 s look-back of 6 s samples
    for lull in range(7):
        queued, running = rng.integers(0, 9, 6).astype(float), rng.integers(0, 5, 6).astype(float)
        queued[:lull] = running[:lull] = 0.0
        now = times[-1] + 4.0
        ray = merge_and_aggregate_arrays(
            np.concatenate([times, times]), np.concatenate([queued, running]), np.array([0, 6, 12]), now
        )
        assert serve_mean(times, queued + running, now) == pytest.approx(ray), lull
    burst = np.array([0, 0, 0, 0, 20.0, 20.0])
    assert serve_mean(times, burst, times[-1]) == 20.0 and np.mean(burst) < 7


def test_idle_replica_ttft_is_its_prompt_not_a_full_token_budget():
    """A request alone on a replica is prefilled in one step of its own prompt tokens (cpu-smollm2:
    57.5 ms + 22 x 1.5 ms), not a step of max_num_batched_tokens (512 tokens: 0.83 s). The old
    formula charged the full budget: every TTFT on the CPU preset was >= 0.83 s, past a 0.5 s SLO."""
    work = SimWorkload("cpu-smollm2", max_num_seqs=4, max_num_batched_tokens=512, prompt_tokens=22, output_tokens=32)
    trace = Trace(np.array([0.0, 600.0]), np.array([0.05, 0.05]))  # one request every 20 s: always alone
    res = FleetSim(trace, work, startup_s=10.0, dt_s=0.05, slo_s=0.5, seed=3).run(schedule=lambda t: 1)
    step = PRESETS["cpu-smollm2"].step
    alone = step.fixed_s + 22 * step.prefill_token_s
    assert res.requests > 10
    assert alone <= res.ttft_quantile(0.5) <= 1.5 * alone
    assert res.within_slo / res.requests > 0.95


def test_a_new_replica_reports_its_own_load_not_an_average_over_before_it_ran():
    """Serve aggregates a replica's own reports, which start when it runs. Saturated (a queue always
    waiting), a replica that just started is full at once: 2 s after it runs its averaged `running`
    is near max_num_seqs (its first report, at start, is 0), not max_num_seqs x 2 s / 30 s look-back (the old average over the whole window)."""
    from ray.serve.config import AutoscalingConfig

    work = SimWorkload("cpu-smollm2", max_num_seqs=4, max_num_batched_tokens=512, prompt_tokens=22, output_tokens=32)
    trace = Trace(np.array([0.0, 60.0]), np.array([20.0, 20.0]))  # 20 req/s: 1 replica does ~1.8
    seen = {}

    def policy(ctx):
        if len(ctx.running_replicas) == 2 and ctx.current_time >= 12.0 and "new" not in seen:
            seen["new"] = ctx.aggregated_metrics["running"][ctx.running_replicas[-1]]
        return 2, {}

    config = AutoscalingConfig(
        min_replicas=1,
        max_replicas=2,
        look_back_period_s=30.0,
        metrics_interval_s=0.5,
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
    )
    FleetSim(trace, work, startup_s=10.0, dt_s=0.1, control_period_s=0.1).run(Policy("p", policy, config))
    assert seen["new"] >= 0.7 * work.max_num_seqs


def test_measured_startups_are_replayed_one_per_replica():
    """Replicas asked together on a small machine land one by one: the simulator can take each one's
    measured start-up in turn (cycling) instead of one figure for all."""
    work = SimWorkload("cpu-smollm2", max_num_seqs=4, prompt_tokens=22, output_tokens=32)
    trace = Trace(np.array([0.0, 30.0]), np.array([0.0, 0.0]))
    res = FleetSim(trace, work, startup_s=99.0, dt_s=0.5, startups_s=[5.0, 10.0]).run(
        schedule=lambda t: 1 if t < 1.0 else 4, initial=1
    )
    ready = dict(zip(res.t, res.ready))
    # Asked at t=1: the first new replica runs at 6, the second at 11, the third (cycling) at 6.
    assert ready[5.0] == 1 and ready[6.0] == 3 and ready[10.0] == 3 and ready[11.0] == 4


def test_requests_in_the_system_reach_zero_after_a_burst():
    """Real requests end; a decaying fluid never does. The old simulator showed the policy a sliver of
    demand forever after a burst (4e-6 requests "in the system" a minute later), which a policy that
    sizes for any arrivals at all (an SLO margin) reads as load: the simulated fleet kept 3 replicas
    through a lull in which real Serve went back to 1 (cluster.sim_check)."""
    from ray.serve.config import AutoscalingConfig

    work = SimWorkload("cpu-smollm2", max_num_seqs=4, prompt_tokens=22, output_tokens=32)
    arrivals = np.arange(0.0, 10.0, 0.5)  # 20 requests in 10 s, then nothing for 50 s
    seen = []

    def policy(ctx):
        seen.append((ctx.current_time, ctx.total_num_requests))
        return 1, {}

    config = AutoscalingConfig(
        min_replicas=1,
        max_replicas=1,
        look_back_period_s=5.0,
        metrics_interval_s=0.5,
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
    )
    FleetSim(
        Trace(np.array([0.0, 60.0]), np.zeros(2)),
        work,
        startup_s=10.0,
        dt_s=0.1,
        control_period_s=0.5,
        arrivals_s=arrivals,
    ).run(Policy("p", policy, config))
    late = [d for t, d in seen if t >= 45.0]
    assert max(d for _, d in seen) > 4 and late and max(late) == 0.0


def test_replica_speed_is_measured_from_requests_that_ran_in_a_full_replica():
    reqs = [
        {"ok": True, "ttft_s": 0.1, "latency_s": 1.0},  # did not queue: a part-full batch, not used
        {"ok": True, "ttft_s": 3.0, "latency_s": 3.0 + 31 * 0.072},
        {"ok": True, "ttft_s": 5.0, "latency_s": 5.0 + 31 * 0.074},
        {"ok": False, "ttft_s": 4.0, "latency_s": None},
    ]
    step = burst.full_step_s(reqs, slo_s=1.0, max_tokens=32)
    assert step == pytest.approx(0.073)
    app = app_config(4)  # sim:cpu-smollm2, 4 sequences
    model = PRESETS["cpu-smollm2"].step.step_seconds(0, 4, 4 * (22 + 16))
    assert sim_check.step_scale_for(app, step, 22, 32) == pytest.approx(0.073 / model)
    assert sim_check.step_scale_for(app, None, 22, 32) == 1.0
    slower = SimWorkload("cpu-smollm2", 4, prompt_tokens=22, output_tokens=32, step_scale=1.1)
    assert slower.throughput_rps(4) < SimWorkload("cpu-smollm2", 4, prompt_tokens=22, output_tokens=32).throughput_rps(
        4
    )


def _prefill_bound(rps: float):
    """One h100-llama3-8b replica of 128 slots fed azure_code-like requests (2048-token prompts,
    28-token answers): one prompt fills a step's 2048-token budget, so it prefills at most
    1 / (fixed + 2048 x prefill cost per token) = 14 requests/s, whatever its slots."""
    work = SimWorkload(
        "h100-llama3-8b", max_num_seqs=128, max_num_batched_tokens=2048, prompt_tokens=2048, output_tokens=28
    )
    step = PRESETS["h100-llama3-8b"].step
    prefill_rps = (
        work.max_num_batched_tokens
        / work.prompt_tokens
        / (step.fixed_s + work.max_num_batched_tokens * step.prefill_token_s)
    )
    return work, Trace(np.array([0.0, 60.0]), np.array([rps, rps])), prefill_rps


def test_a_replica_completes_no_more_requests_than_it_prefills():
    """Only sequences whose prompt is prefilled decode and end. The old simulator decoded every
    admitted sequence each step whatever the prefill backlog: a replica fed 30 req/s of 2048-token
    prompts "completed" ~30/s (running / 28 per step) while it could prefill 14/s, so its slots never
    filled, nothing queued and TTFT grew to minutes unseen by any policy."""
    work, trace, prefill_rps = _prefill_bound(30.0)
    sim = FleetSim(trace, work, startup_s=10.0, dt_s=0.25, seed=1)
    sim.run(schedule=lambda t: 1)
    completed_rps = sim.finished.sum() / trace.duration_s
    assert 0.8 * prefill_rps <= completed_rps <= 1.02 * prefill_rps


def test_prompts_queued_in_a_replica_are_reported_waiting():
    """A real engine reports admitted requests whose prefill has not started as `waiting` (the
    scheduler's queue), the others as `running`; the old simulator reported waiting 0 always. Fed
    twice what it prefills, a replica's slots fill with prompts to prefill: most of them wait, and
    then requests queue at the handles too."""
    from ray.serve.config import AutoscalingConfig

    work, trace, prefill_rps = _prefill_bound(2 * 14.0)
    seen = []

    def policy(ctx):
        r = ctx.running_replicas[0]
        seen.append(
            (
                ctx.current_time,
                ctx.aggregated_metrics["waiting"][r],
                ctx.aggregated_metrics["running"][r],
                ctx.total_queued_requests,
                ctx.total_num_requests,
            )
        )
        return 1, {}

    config = AutoscalingConfig(
        min_replicas=1,
        max_replicas=1,
        look_back_period_s=5.0,
        metrics_interval_s=1.0,
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
    )
    FleetSim(trace, work, startup_s=10.0, dt_s=0.25, seed=2).run(Policy("p", policy, config))
    late = [s for s in seen if s[0] >= 40.0]
    assert late and all(waiting > 0.5 * work.max_num_seqs and queued > 0 for _, waiting, _, queued, _ in late)
    # Waiting and running split the replica's requests: with the handle queue, the total in the system.
    _, waiting, running, queued, total = late[-1]
    assert waiting + running == pytest.approx(work.max_num_seqs, rel=0.05)
    assert waiting + running + queued == pytest.approx(total, rel=0.1)
