"""The router's cost model learned from what replicas measure (router.cost_model), with plain data:
engine counters as a replica's engine keeps them, reports as LLMServer sends them, no Ray cluster;
last, the capacity check (load_tests.capacity_check) on a real engine."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from batcher.outputs import EngineStats
from batcher.simulated import PRESETS, StepTimeModel
from router.cost_model import StepMeter, capacity_rps, coefficients, completion_rate, learned_step
from tests.router_harness import blocks, make_router, replica, request

H100, CPU = PRESETS["h100-llama3-8b"].step, PRESETS["cpu-smollm2"].step
# A device whose prefill is 30x slower than the H100 preset's (the rest alike): a cache hit saves much.
SLOW_PREFILL = dataclasses.replace(H100, prefill_token_s=30 * H100.prefill_token_s)


def measured(truth: StepTimeModel, steps: int, seed: int = 0, report_every: int = 10, busy: float = 0.05) -> dict:
    """A replica's `step_fit` after `steps` engine steps timed by `truth` (+-10% noise), its counters
    kept as LLMEngine keeps them (EngineStats) and read at every report: prompts of 50-2000 tokens
    arriving at random, each decoding until it ends at random; stepping `busy` of the time."""
    return metered(truth, steps, seed, report_every, busy).fit()


def metered(truth: StepTimeModel, steps: int, seed: int = 0, report_every: int = 10, busy: float = 0.05) -> StepMeter:
    """The StepMeter of `measured`: 0.4 prompts a step (mean 1025 tokens), 0.05 of the running ending
    a step (21 tokens generated each on average): about 8 running."""
    rng, stats, meter, running = np.random.default_rng(seed), EngineStats(), StepMeter(), []  # [context, generated]
    meter.observe(stats, now_s=0.0)
    for k in range(steps):
        prefill = int(rng.integers(50, 2000)) if rng.random() < 0.4 else 0
        decode = len(running)
        stats.tokens_computed += prefill + decode
        stats.generated_tokens += decode + (prefill > 0)
        running = [[n, g + 1] for n, g in running] + ([[prefill, 1]] if prefill else [])
        stats.step_seconds += truth.step_seconds(prefill, decode, sum(n for n, _ in running)) * rng.uniform(0.9, 1.1)
        stats.steps += 1
        ended = [i for i in range(len(running)) if rng.random() < 0.05]
        stats.ended_output_tokens += sum(running[i][1] for i in ended)
        running = [[n + 1, g] for i, (n, g) in enumerate(running) if i not in ended]
        stats.finished_requests += len(ended)
        stats.running, stats.context_tokens = len(running), sum(n for n, _ in running)
        if k % report_every == report_every - 1:
            meter.observe(stats, now_s=stats.step_seconds / busy)
    return meter


def test_measured_step_times_replace_a_wrong_preset():
    """Prior the CPU preset, hardware the H100's (and the reverse): after a few hundred steps the
    learned model predicts the hardware's steps, not the preset's; after three, the preset's."""
    for truth, prior in ((H100, CPU), (CPU, H100)):
        learned = learned_step(prior, measured(truth, 600))
        for step in ((2048, 0, 0), (512, 8, 8000), (0, 8, 10_000)):  # within what was measured
            assert learned.step_seconds(*step) == pytest.approx(truth.step_seconds(*step), rel=0.3), step
        assert learned.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=0.2)
        early = learned_step(prior, measured(truth, 3, report_every=1)).step_seconds(2048, 0, 0)
        ratio = early / prior.step_seconds(2048, 0, 0)
        assert 0.5 < ratio < 2, ratio  # the preset's, give or take, not the hardware's (40x off)
    assert learned_step(CPU, {}) == CPU and learned_step(CPU, None) == CPU


def scene(router, fit, now, age_s=0.1):
    """A holder of the request's first 1500 tokens, decoding 64 long conversations, and an idle replica,
    both reporting `fit`. (The routers here have a loose load bound: the cost decides, not the count.)"""
    holder = replica("holder", now, age_s=age_s, running=64, context_tokens=64 * 2500, step_fit=fit)
    idle = replica("idle", now, age_s=age_s, step_fit=fit)
    prompt = list(range(5000, 6600))
    router.index.insert("holder", blocks(prompt[:1500]))
    return router.score([holder, idle], router.prepare(request(prompt, max_tokens=16)), now)


def test_the_learned_prefill_rate_decides_whether_a_cache_hit_is_worth_a_busy_holder():
    """The same fleet, the same H100 preset as the prior: where the replicas measure the preset's fast
    prefill, recomputing 1500 tokens on the idle replica beats joining the holder's big batch; where
    they measure a prefill 30x slower, the cache hit is worth it. The old router read only the preset."""
    now = time.time()
    fast = scene(make_router(load_bound=4), measured(H100, 1200), now)
    slow = scene(make_router(load_bound=4), measured(SLOW_PREFILL, 1200), now)
    assert fast[0].replica == "idle" and slow[0].replica == "holder"
    preset_only = make_router(learn_step_times=False, load_bound=4)
    assert scene(preset_only, measured(SLOW_PREFILL, 1200), now)[0].replica == "idle"


def test_a_busy_fleet_keeps_a_session_on_its_cache_an_idle_one_moves_it():
    """Fast prefill, as above: with the fleet stepping 5% of the time the request moves to the idle
    replica; with it stepping 95% of the time (as the replicas measure it), the 1500 tokens it would
    recompute there are work every later request waits for, and it stays with its cache."""
    now = time.time()
    assert scene(make_router(load_bound=4), measured(H100, 1200, busy=0.05), now)[0].replica == "idle"
    assert scene(make_router(load_bound=4), measured(H100, 1200, busy=0.95), now)[0].replica == "holder"


def test_a_stale_reports_step_times_are_unknown_so_the_prior():
    now = time.time()
    slow_fit = measured(SLOW_PREFILL, 1200)
    stale = scene(make_router(max_stats_age_s=5, load_bound=4), slow_fit, now, age_s=30)
    prior = scene(make_router(max_stats_age_s=5, learn_step_times=False, load_bound=4), slow_fit, now, age_s=30)
    assert [s.seconds for s in stale] == pytest.approx([s.seconds for s in prior])
    fresh = scene(make_router(max_stats_age_s=5, load_bound=4), slow_fit, now)
    assert fresh[0].seconds > 2 * prior[0].seconds  # fresh, the measured slow prefill counts


def test_the_meter_reports_nothing_before_a_step_and_forgets_old_samples():
    meter, stats = StepMeter(window=4), EngineStats()
    meter.observe(stats, now_s=0.0)
    meter.observe(stats, now_s=1.0)
    assert meter.fit() == {}
    for k in range(10):
        stats = dataclasses.replace(
            stats,
            steps=stats.steps + 5,
            step_seconds=stats.step_seconds + 0.05,
            tokens_computed=stats.tokens_computed + 5,
            generated_tokens=stats.generated_tokens + 5,
        )
        meter.observe(stats, now_s=2.0 + k * 0.1)
    fit = meter.fit()
    assert fit["steps"] == 20  # the last 4 intervals of 5 steps
    assert fit["busy"] == pytest.approx(0.5 / 2.9)  # 0.05 s stepping in each 0.1 s after 2 s idle
    assert np.asarray(fit["xtx"]).shape == (4, 4) and len(fit["xty"]) == 4
    assert coefficients(learned_step(H100, fit))[0] > 0


def test_a_replica_says_what_it_would_complete_full_without_running_full():
    """About 8 of 128 slots running, prior another device's (over 5x off): the meter's capacity is
    the hardware's at its requests' size, within 15%; long prompts bound it by the step's token
    budget, a KV cache by the sequences it holds."""
    for truth, prior in ((H100, CPU), (SLOW_PREFILL, H100)):
        meter = metered(truth, 3000)
        prompt, output = meter.request_size()
        assert prompt == pytest.approx(1025, rel=0.1) and output == pytest.approx(21, rel=0.15)
        full = capacity_rps(truth, 128, 2048, prompt, output)
        assert meter.capacity(prior, 128, 2048) == pytest.approx(full, rel=0.15)
        # Prefill-bound: 2048 tokens a step replace ~42 running, not 128.
        assert full == pytest.approx(completion_rate(truth, 2048 * output / prompt, prompt, output))
        wrong = capacity_rps(prior, 128, 2048, prompt, output)  # the prior's: many times off
        assert max(wrong / full, full / wrong) > 5
        kv_bound = meter.capacity(prior, 128, 2048, kv_tokens=10 * (prompt + output / 2))
        assert kv_bound == pytest.approx(capacity_rps(learned_step(prior, meter.fit()), 10, 2048, prompt, output))
    fresh = StepMeter()
    fresh.observe(EngineStats(), now_s=0.0)
    assert fresh.request_size() is None and fresh.capacity(H100, 128, 2048) == 0.0  # nothing ended yet


def test_the_capacity_check_estimates_light_then_counts_full(tmp_path):
    """`python -m load_tests.capacity_check` on tiny-llama, seconds per phase: the light phase's
    estimate, the full phase's completions and the request size it read (unique ~76-token prompts
    computed whole, 16 tokens generated each), in its JSON."""
    from load_tests import capacity_check

    out = tmp_path / "capacity.json"
    result = capacity_check.main(
        ["--model", "tiny-llama", "--seconds", "3", "--warmup-s", "1", "--max-tokens", "16", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert result["light_rps"] > 0 and result["full_rps"] > 0 and result["capacity_estimate_rps"] > 0
    assert 60 < result["prompt_tokens_computed"] < 90 and 12 < result["tokens_generated"] <= 17
    assert result["estimate_over_full"] == result["capacity_estimate_rps"] / result["full_rps"]
