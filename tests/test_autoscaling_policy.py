"""QueueDepthPolicy (two knobs: the TTFT SLO and the start-up time) with constructed
AutoscalingContexts, run through Serve's own wrapper (`_apply_autoscaling_config`: factors, delays) and
bounds, as the controller runs it."""

from __future__ import annotations

import functools
import importlib

import pytest

# Private in Ray 2.60, no public equivalent: the point type of AutoscalingContext.raw_metrics, and the
# wrapper Serve's controller puts around every policy.
from ray.serve._private.common import TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.app import build_app, llm_deployment_options, load_config
from deployments.autoscaling import POLICY_PATH, SERVE_POLICY_PATH, YOUNG_HOLD, QueueDepthPolicy, queue_depth_policy
from deployments.config import AutoscalingConfig as AppAutoscaling


def ctx(
    target,
    ready=None,
    running=(),
    waiting=(),
    kv=(),
    handle_queued=0.0,
    total=None,
    finished=None,
    preempted=(),
    state=None,
    now=0.0,
    lo=1,
    hi=100,
    config=None,
    capacity=None,
):
    """A context as the controller builds it; per-replica lists are indexed by replica."""
    ready = target if ready is None else ready
    ids = [f"r{i}" for i in range(ready)]
    running = list(running) + [0.0] * (ready - len(running))
    waiting = list(waiting) + [0.0] * (ready - len(waiting))
    kv = list(kv) + [0.0] * (ready - len(kv))
    if total is None:
        total = sum(running) + sum(waiting) + handle_queued
    raw = {}
    if finished is not None:  # finished[i] requests per second over a 5 s window
        raw["finished"] = {
            r: [TimeStampedValue(now - 5, 0.0), TimeStampedValue(now, 5 * finished[i])] for i, r in enumerate(ids)
        }
    raw["preemptions"] = {
        r: [TimeStampedValue(now - 5, 0.0), TimeStampedValue(now, 3.0 if i in preempted else 0.0)]
        for i, r in enumerate(ids)
    }
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="LLMServer",
        app_name="app",
        current_num_replicas=ready,
        target_num_replicas=target,
        running_replicas=ids,
        total_num_requests=total,
        total_queued_requests=handle_queued,
        aggregated_metrics={
            "running": dict(zip(ids, running)),
            "waiting": dict(zip(ids, waiting)),
            "kv_usage": dict(zip(ids, kv)),
            **({"capacity": dict(zip(ids, capacity))} if capacity is not None else {}),
        },
        raw_metrics=raw,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        policy_state=state or {},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config or default_config(),
    )


def serve_config(**kw):
    return AutoscalingConfig(**AppAutoscaling(max_replicas=100, **kw).to_serve())


@functools.lru_cache(maxsize=1)
def default_config():
    return serve_config()  # built once: Serve pickles the policy on every construction


# Replicas of 10 slots doing 2 req/s when full, a 4 s SLO: the policy asks for the fewest replicas
# with under 1% of requests waiting past the SLO (M/M/c over the slots): 4 req/s -> 3, 18 -> 10, 24 -> 13.
SLOTS, MU, STARTUP = 10, 2.0, 30.0


def policy(**kw):
    return QueueDepthPolicy(replica_slots=SLOTS, **{"slo_s": 4.0, "startup_s": STARTUP, **kw})


def measured(p, now=-1000.0):
    """A tick with both replicas full and requests queued: mu = 2 req/s is measured (no ask: hi 2)."""
    _, state = p(ctx(2, running=[10, 10], handle_queued=5, finished=[MU, MU], now=now, hi=2))
    return state


def replay(p, state, load, t0, t1, target=10, lo=1):
    """Ticks of 1 s from t0 to t1 at `load(t)` req/s over the ready replicas (5 running each while
    busy, none full; requests wait at the handles while the load is over what they do); replicas
    asked for run STARTUP s later. Returns {t: target} and the state."""
    out, ready, landing = {}, target, None
    for t in range(t0, t1):
        if landing and t >= landing[0]:
            ready, landing = landing[1], None
        rps = load(t)
        n, state = p(
            ctx(
                target,
                ready=ready,
                running=[5.0 if rps else 0.0] * ready,
                handle_queued=1.0 if rps > ready * MU else 0.0,
                finished=[rps / max(ready, 1)] * ready,
                now=float(t),
                state=state,
                lo=lo,
            )
        )
        if n > max(ready, target):
            landing = (t + STARTUP, n)
        elif n < ready:
            ready, landing = n, None
        out[t], target = n, n
    return out, state


def test_a_burst_is_sized_from_the_rate_and_the_backlog():
    p = policy()
    # Both replicas full (10 of 10 slots) with 600 requests queued at the handles: mu = 2 req/s is
    # measured on this tick; 4 req/s arrive (completions, no growth yet). The rate needs 3 replicas;
    # draining the 600 within one start-up (30 s) on top: 4 + 600 / 30 = 24 req/s -> 13.
    n, state = p(ctx(2, running=[10, 10], handle_queued=600, finished=[MU, MU], now=0))
    assert n == 13 and state["iterserve"]["mu"] == MU
    # 5 s later, 100 more queued: arrivals are 4 + 20 req/s (smoothed over a 5 s bucket: 16.6) and the
    # backlog is re-estimated from the queue now, not added to the first ask:
    # 16.6 + 700 / 30 = 40 req/s -> 21 (adding up would give 13 + 12 + ... > 24).
    n, state = p(ctx(n, ready=2, running=[10, 10], handle_queued=700, finished=[MU, MU], now=5, state=state))
    assert n == 21
    # The queue shrinks: nothing more is asked for.
    n, state = p(ctx(n, ready=2, running=[10, 10], handle_queued=650, finished=[MU, MU], now=10, state=state))
    assert n <= 21


def test_before_any_completion_the_queue_counts_as_load_at_the_slots():
    # Nothing completed yet (a first burst): 20 running + 30 queued = 50 requests, at 10 slots with a
    # sqrt-staffing margin: (50 + 7.1) / 10 = 5.7 -> 6.
    n, _ = policy()(ctx(2, running=[10, 10], handle_queued=30))
    assert n == 6


def test_a_lull_after_one_isolated_burst_scales_down_after_a_start_up():
    p = policy()
    out, _ = replay(p, measured(p), lambda t: 18.0 if t < 40 else 0.0, 0, 200)
    # 18 req/s need 10 replicas; the last 5 s bucket that needed them ends at t = 40: they stay one
    # start-up (30 s) after it, then go.
    assert all(out[t] == 10 for t in range(0, 70))
    assert out[75] < 10 and out[199] == 1


def test_a_young_memory_keeps_a_burst_shorter_than_a_start_up_and_rebuys_a_longer_one():
    # The memory is younger than its span (measured 10 s before): nothing says yet whether a burst
    # recurs. One over before replicas bought for it land (20 s < the 30 s start-up) can only be met
    # by replicas kept: its 10 replicas stay YOUNG_HOLD start-ups after its last bucket (ends at 20).
    p = policy()
    out, _ = replay(p, measured(p, now=-10.0), lambda t: 18.0 if t < 20 else 0.0, 0, 400)
    hold = YOUNG_HOLD * STARTUP
    assert all(out[t] == 10 for t in range(0, int(20 + hold)))
    assert out[399] == 1
    # One that held a start-up or longer (40 s) is re-bought like the first time: rent or buy, one
    # start-up after its last bucket.
    p = policy()
    out, _ = replay(p, measured(p, now=-10.0), lambda t: 18.0 if t < 40 else 0.0, 0, 200)
    assert all(out[t] == 10 for t in range(0, 70))
    assert out[75] < 10 and out[199] == 1


def test_recurring_bursts_keep_their_capacity_through_the_lulls():
    p = policy()
    # 40 s bursts every 120 s, three of them, then silence.
    out, _ = replay(p, measured(p), lambda t: 18.0 if t % 120 < 40 and t < 360 else 0.0, 0, 800)
    # The first is isolated: released after a start-up, and met by 1 replica when it comes back.
    assert out[100] == 1
    # From the second on, 10 replicas recur: kept through the 80 s lulls and the long silence after the
    # last burst (it ends at 280; its level held while the silence is under 3 mean gaps + a start-up).
    assert all(out[t] == 10 for t in range(200, 560))
    assert out[799] == 1


def test_steady_load_inside_the_margin_never_moves():
    p = policy()
    # 10..13 req/s wandering (6 to 7 replicas): after two start-ups of it, the
    # fleet holds one count, neither up nor down.
    out, _ = replay(p, measured(p), lambda t: 11.5 + 1.5 * ((t * 7919) % 13 - 6) / 6, 0, 660, target=9)
    held = {out[t] for t in range(120, 660)}
    assert len(held) == 1 and held <= {7, 8, 9}, out


def test_a_need_flickering_at_a_threshold_holds_one_count_and_then_goes():
    """After a burst, a tail whose rate wanders across the 1 -> 2 replica threshold (1.22-1.38 req/s;
    2 replicas from 1.33) holds 2 replicas, never flapping down and up again (each re-buy lands a
    start-up late), and is released within a start-up of its end."""
    p = policy()
    state, out, ready, target = measured(p), {}, 10, 10

    def rate(t):
        if t < 40:
            return 18.0
        return 1.30 + 0.08 * (((t // 5) * 7919) % 13 - 6) / 6 if t < 400 else 0.0

    for t in range(0, 500):  # running = rate x 2 s latency (Little), spread over the ready replicas
        rps = rate(t)
        n, state = p(
            ctx(
                target,
                ready=ready,
                running=[rps * 2.0 / ready] * ready,
                finished=[rps / ready] * ready,
                now=float(t),
                state=state,
            )
        )
        ready = min(ready, n) if n < ready else ready  # scale-downs act at once; the tail never needs more
        out[t], target = n, n
    tail = [out[t] for t in range(130, 400)]
    assert set(tail) == {2}, tail
    assert all(out[t] <= 1 for t in range(400 + int(STARTUP) + 10, 500))


def _steady_fleet(p, rates, queued=lambda t: 0.0, target=100):
    """Ticks of 1 s at rates[t] req/s over a fleet that lands at once (running = rate x 2 s, Little),
    from the measured state; returns {t: target}. 197 req/s need 100 replicas, 201 need 102."""
    state, out = measured(p), {}
    for t, rps in enumerate(rates):
        n, state = p(
            ctx(
                target,
                running=[rps * 2.0 / target] * target,
                finished=[rps / target] * target,
                handle_queued=queued(t),
                now=float(t),
                state=state,
                hi=200,
            )
        )
        out[t], target = n, n
    return out


def test_a_rise_under_the_noise_band_waits_for_a_queue():
    # 100 replicas at 197 req/s, then a rate swinging between 195 and 203 every 5 s (99 and 103
    # replicas: within sqrt(100) / 2 of the fleet either way; never rising long enough to be a ramp).
    rates = [197.0] * 60 + [199.0 + 4.0 * (-1) ** (t // 5) for t in range(60, 300)]
    calm = _steady_fleet(policy(), rates)
    assert set(calm.values()) == {100}, calm  # nothing waits: noise, not load
    # The same with requests waiting from t = 200: more replicas at once.
    queued = _steady_fleet(policy(), rates, queued=lambda t: 5.0 if t >= 200 else 0.0)
    assert set(queued[t] for t in range(0, 200)) == {100}, queued
    assert all(queued[t] > 100 for t in range(201, 300)), queued


def test_a_dip_in_the_arrival_estimate_is_not_a_drop_until_a_bucket_saw_it():
    # Completions read low for 3 s across two 5 s buckets (a backlog drained, replicas left: the
    # estimate dips, the load does not): the fleet holds its 100 instead of dropping and buying back.
    rates = [197.0] * 123 + [120.0] * 3 + [197.0] * 60
    out = _steady_fleet(policy(), rates)
    # (Later, the climb back over five buckets reads as a ramp: a known limit of the ramp rule.)
    assert set(out[t] for t in range(60, 150)) == {100}, out


def test_kv_pressure_marks_a_replica_full_and_its_rate_is_mu():
    # No queue, but replica 0's KV cache is full: its completion rate (1.5 req/s) is what a replica does.
    _, state = policy()(ctx(2, running=[4, 3], kv=[0.95, 0.3], finished=[1.5, 1.0]))
    assert state["iterserve"]["mu"] == 1.5
    _, state = policy()(ctx(2, running=[4, 3], kv=[0.5, 0.3], finished=[1.5, 1.0]))
    assert "mu" not in state["iterserve"]


def test_startup_is_measured_from_ask_to_running():
    p = policy(startup_s=30.0)
    n, state = p(ctx(2, running=[10, 10], handle_queued=75, now=100))
    assert n > 2
    _, state = p(ctx(n, ready=2, running=[10, 10], handle_queued=75, state=state, now=120))
    assert "startup_s" not in state["iterserve"]  # not all run yet
    _, state = p(ctx(n, ready=n, running=[5] * n, state=state, now=145))
    assert state["iterserve"]["startup_s"] == 45.0


def test_knobs_are_the_slo_and_the_startup_only():
    from pydantic import ValidationError

    QueueDepthPolicy(slo_s=0.5, startup_s=120)
    with pytest.raises(ValidationError, match="Extra inputs"):
        QueueDepthPolicy(slo=1.0)
    with pytest.raises(ValidationError, match="greater than 0"):
        QueueDepthPolicy(slo_s=0)
    # A config of the 13-knob version names what replaced its knobs.
    with pytest.raises(
        ValidationError, match="max_queue_wait_s, target_running: removed; the policy takes only slo_s and startup_s"
    ):
        QueueDepthPolicy(target_running=48, max_queue_wait_s=2.0)


def test_bounds_and_scale_to_zero():
    p = policy()
    state = measured(p)
    # min 1: the last replica stays; min 0: it leaves a start-up after the last request.
    out, _ = replay(p, state, lambda t: 0.0, 0, 100, target=1, lo=1)
    assert out[99] == 1
    p = policy()
    out, _ = replay(p, measured(p), lambda t: 0.5 if t < 10 else 0.0, 0, 100, target=1, lo=0)
    assert out[30] == 1 and out[99] == 0
    # max bound holds under any burst.
    n, _ = p(ctx(2, running=[10, 10], handle_queued=1000, hi=6))
    assert n == 6


def test_through_serves_wrapper_no_extra_delay_and_cold_start_from_zero():
    """Serve wraps the policy; with the app's defaults for this policy its delays add nothing."""
    wrapped = _apply_autoscaling_config(policy())
    n, _ = wrapped(ctx(2, running=[10, 10], handle_queued=75))
    assert n == 11  # (95 + 9.7) / 10 = 10.5, as the policy decides alone
    # Zero replicas and a request waiting at a handle: Serve's cold-start path asks for one.
    n, _ = wrapped(ctx(0, ready=0, handle_queued=3, lo=0))
    assert n == 1
    # Serve's own delays would hold the same burst back (30 s upscale delay).
    slow = _apply_autoscaling_config(policy())
    n, _ = slow(
        ctx(
            2,
            running=[10, 10],
            handle_queued=75,
            config=AutoscalingConfig(**AppAutoscaling(max_replicas=100, upscale_delay_s=30).to_serve()),
        )
    )
    assert n == 2


def test_plain_function_form_uses_default_knobs():
    # No slots given: measured from the replica full with requests queued (48); nothing completed yet,
    # so the 96 requests count as load at those slots: (96 + 9.8) / 48 = 2.2 -> 3.
    n, state = queue_depth_policy(ctx(1, running=[48], handle_queued=48))
    assert n == 3 and state["iterserve"]["slots"] == 48


def test_the_built_options_leave_the_queue_depth_policy_its_own_timing():
    """The app's autoscaling options, through Serve's wrapper as the controller applies them: every
    decision of the queue-depth policy comes out as the policy made it (its own dwell; no Serve
    delay, factor or smoothing on top), over a burst, the steps down and scale to zero."""
    knobs = {"slo_s": 4.0, "startup_s": 10.0}
    auto = llm_deployment_options(
        load_config(
            {
                "engine": {"max_num_seqs": 10},
                "autoscaling": {"min_replicas": 0, "max_replicas": 8, "policy_kwargs": knobs},
            }
        )
    )["autoscaling_config"]
    # The replica's slots come from the engine config (the smaller of max_num_seqs and max_ongoing_requests).
    knobs["replica_slots"] = 10
    assert auto["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": knobs}
    # The path Serve's controller imports names this class (a stale path fails only at deploy time).
    module, _, name = POLICY_PATH.partition(":")
    assert getattr(importlib.import_module(module), name) is QueueDepthPolicy
    config = AutoscalingConfig(**auto)
    bare, wrapped = QueueDepthPolicy(**knobs), _apply_autoscaling_config(QueueDepthPolicy(**knobs))
    target, bare_state, wrapped_state, decisions = 1, {}, {}, []
    for t in range(400):
        demand = 5 if t < 5 else 60 if t < 30 else 20 if t < 200 else 0
        running = [min(10.0, demand / target)] * target if target else []
        queued = max(0.0, demand - sum(running))
        n, bare_state = bare(
            ctx(target, running=running, handle_queued=queued, now=t, lo=0, hi=8, state=bare_state, config=config)
        )
        w, wrapped_state = wrapped(
            ctx(target, running=running, handle_queued=queued, now=t, lo=0, hi=8, state=wrapped_state, config=config)
        )
        assert w == n, (t, w, n)
        decisions.append(n)
        target = n
    steps = [b - a for a, b in zip(decisions, decisions[1:]) if b != a]
    assert max(steps) >= 5 and min(steps) < 0 and decisions[-1] == 0, decisions  # each case was met


def test_serves_policy_selected_keeps_serves_own_timing():
    """Selecting Serve's policy brings back Serve's own delays (those of Serve's defaults, not ours):
    through the wrapper a burst waits, where the queue-depth policy acts at once."""
    auto = llm_deployment_options(load_config({"autoscaling": {"policy": SERVE_POLICY_PATH, "max_replicas": 100}}))[
        "autoscaling_config"
    ]
    config, serves = AutoscalingConfig(**auto), AutoscalingConfig()
    for field in ("look_back_period_s", "upscale_delay_s", "downscale_delay_s"):
        assert getattr(config, field) == getattr(serves, field), field
    module, _, name = SERVE_POLICY_PATH.partition(":")
    serve_policy = _apply_autoscaling_config(getattr(importlib.import_module(module), name))
    burst = dict(running=[32, 32], handle_queued=300, config=config)
    wants, _ = getattr(importlib.import_module(module), name)(ctx(2, **burst))
    n, _ = serve_policy(ctx(2, **burst))
    assert wants > 2 and n == 2  # Serve's policy wants more; its upscale delay holds the burst back


def test_the_metric_push_interval_follows_the_config_in_every_process():
    """Ray 2.60 reads the interval from autoscaling_config; later versions from the environment of the
    processes holding handles (the ingress) and serving replicas: all three follow the config."""
    ingress = build_app({"engine": {"model": "sim:cpu-smollm2"}, "autoscaling": {"metrics_interval_s": 0.7}})
    llm = ingress._bound_deployment.init_args[0]._bound_deployment
    assert llm._deployment_config.autoscaling_config.metrics_interval_s == 0.7
    for d in (ingress._bound_deployment, llm):
        env = d.ray_actor_options["runtime_env"]["env_vars"]
        assert env["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "0.7"
        assert env["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "0.7"


def test_unknown_policy_knob_fails_the_deploy():
    from deployments.app import ConfigError

    with pytest.raises(ConfigError, match="slo_ss"):
        build_app({"autoscaling": {"policy_kwargs": {"slo_ss": 3}}})
    with pytest.raises(ConfigError, match="queue_drain_s: removed; the policy takes only slo_s and startup_s"):
        build_app({"autoscaling": {"policy_kwargs": {"startup_s": 300, "queue_drain_s": 30}}})
    with pytest.raises(ConfigError, match="startup_s"):
        build_app({"autoscaling": {"policy_kwargs": {"startup_s": -1}}})
    # The replica's slots are derived from the engine config, not a knob.
    with pytest.raises(ConfigError, match="replica_slots"):
        build_app({"autoscaling": {"policy_kwargs": {"replica_slots": 8}}})
