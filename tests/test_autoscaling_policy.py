"""QueueDepthPolicy with constructed AutoscalingContexts, run through Serve's own wrapper
(`_apply_autoscaling_config`: factors, delays) and bounds, as the controller runs it."""
from __future__ import annotations

import importlib

import pytest
# Private in Ray 2.60, no public equivalent: the point type of AutoscalingContext.raw_metrics, and the
# wrapper Serve's controller puts around every policy.
from ray.serve._private.common import TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.app import build_app, llm_deployment_options, load_config
from deployments.autoscaling import POLICY_PATH, SERVE_POLICY_PATH, QueueDepthPolicy, queue_depth_policy
from deployments.config import AutoscalingConfig as AppAutoscaling

T = 10.0  # target_running in these tests


def ctx(target, ready=None, running=(), waiting=(), kv=(), handle_queued=0.0, total=None, finished=None,
        preempted=(), state=None, now=0.0, lo=1, hi=100, config=None):
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
        raw["finished"] = {r: [TimeStampedValue(now - 5, 0.0), TimeStampedValue(now, 5 * finished[i])]
                           for i, r in enumerate(ids)}
    raw["preemptions"] = {r: [TimeStampedValue(now - 5, 0.0), TimeStampedValue(now, 3.0 if i in preempted else 0.0)]
                          for i, r in enumerate(ids)}
    return AutoscalingContext(
        deployment_id=None, deployment_name="LLMServer", app_name="app", current_num_replicas=ready,
        target_num_replicas=target, running_replicas=ids, total_num_requests=total,
        total_queued_requests=handle_queued,
        aggregated_metrics={"running": dict(zip(ids, running)), "waiting": dict(zip(ids, waiting)),
                            "kv_usage": dict(zip(ids, kv))},
        raw_metrics=raw, capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=config or serve_config())


def serve_config(**kw):
    return AutoscalingConfig(**AppAutoscaling(max_replicas=100, **kw).to_serve())


def policy(**kw):
    return QueueDepthPolicy(target_running=T, **kw)


def test_burst_jumps_straight_to_the_count_it_needs():
    # 2 replicas full and 75 more requests queued at the handles: 95 requests / 10 = 10 replicas at once.
    n, _ = policy()(ctx(2, running=[10, 10], handle_queued=75))
    assert n == 10


def test_starting_replicas_count_as_capacity_on_the_way():
    # The same burst while the 8 extra replicas start: nothing more is added.
    n, _ = policy()(ctx(10, ready=2, running=[10, 10], handle_queued=75))
    assert n == 10
    # Demand beyond what is on the way adds only the difference.
    n, _ = policy()(ctx(10, ready=2, running=[10, 10], handle_queued=95))
    assert n == 12


def test_engine_queue_and_handle_queue_both_count():
    n, _ = policy()(ctx(2, running=[10, 10], waiting=[15, 15], total=50))
    assert n == 5


def test_expected_queue_wait_from_measured_throughput_adds_replicas():
    # Replicas cap out at 4 running (long prompts) though sized for 10: by count 20 requests fit, but
    # 12 queued at 1 req/s per replica is a 6 s wait. Service time 4 s (Little), 4 per replica:
    # (2 req/s + 12 / 60 s drain) x 4 s / 4 = 2.2 -> 3 replicas.
    p = policy(max_queue_wait_s=2.0, queue_drain_s=60.0)
    n, state = p(ctx(2, running=[4, 4], waiting=[6, 6], finished=[1.0, 1.0], now=0))
    assert n == 3
    # The queue grows by 10 in 5 s: arrivals are 2 + 2 req/s, and new replicas (startup_s 30) will
    # find the queue grown by 2 req/s x 30 s: (4 + (22 + 60) / 60) x 4 / 4 = 5.4 -> 6.
    n, _ = p(ctx(2, running=[4, 4], waiting=[11, 11], finished=[1.0, 1.0], now=5, state=state))
    assert n == 6
    # The same queue served fast (10 req/s per replica): 0.6 s wait, no replica added.
    n, _ = p(ctx(2, running=[4, 4], waiting=[6, 6], finished=[10.0, 10.0]))
    assert n == 2


def test_a_draining_queue_adds_nothing_until_it_is_gone():
    p = policy()
    n, state = p(ctx(2, running=[8, 8], waiting=[6, 6], finished=[10.0, 10.0], now=0))
    assert n == 2  # 16 running fit; the queue is a 0.6 s wait
    # Replicas took up the queue (12 running each, over target) and it shrinks: they run full by
    # design while it drains, so no replica is added for it...
    n, state = p(ctx(2, running=[12, 12], waiting=[2, 2], finished=[10.0, 10.0], now=5, state=state))
    assert n == 2
    # ...and once it is gone, 24 running over a capacity of 20 is load: one more replica.
    n, _ = p(ctx(2, running=[12, 12], finished=[10.0, 10.0], now=10, state=state))
    assert n == 3


def test_only_replicas_that_land_while_the_backlog_is_there_are_asked_for_it():
    # Replicas that run 4 at 1 req/s each (as above).
    p = policy(max_queue_wait_s=2.0, startup_s=60.0, queue_drain_s=30.0)
    n, state = p(ctx(2, running=[4, 4], waiting=[6, 6], finished=[1.0, 1.0], now=0))
    assert n == 3  # (2 req/s + 12 / 30 s) x 4 s / 4 = 2.4
    # 5 s in, the queue grows 2 req/s: replicas asked now find 22 + 2 x 55 queued when they land.
    n, state = p(ctx(3, ready=2, running=[4, 4], waiting=[11, 11], finished=[1.0, 1.0], now=5, state=state))
    assert n == 9  # (4 + 132 / 30) x 4 / 4 = 8.4
    # 40 s in (past queue_drain_s): a replica asked now lands after the first ones drained the
    # backlog, so only the arrival rate counts ((4 + 0) x 4 / 4 = 4, under the 9 on the way), not
    # the 200 queued ((4 + 240 / 30) x 4 / 4 = 12).
    _, state = p(ctx(9, ready=2, running=[4, 4], waiting=[95, 95], finished=[1.0, 1.0], now=35, state=state))
    n, _ = p(ctx(9, ready=2, running=[4, 4], waiting=[100, 100], finished=[1.0, 1.0], now=40, state=state))
    assert n == 9


def test_kv_pressure_caps_a_replicas_capacity():
    # 16 requests on 2 replicas fit by count (capacity 20), but replica 0's KV cache is full with 4
    # running: it takes no more, so capacity is 4 + 10 and one replica is added.
    n, _ = policy()(ctx(2, running=[4, 8], waiting=[4, 0], kv=[0.95, 0.3]))
    assert n == 3
    # A replica that preempts counts the same way.
    n, _ = policy()(ctx(2, running=[4, 8], waiting=[4, 0], preempted=[0]))
    assert n == 3
    n, _ = policy()(ctx(2, running=[4, 8], waiting=[4, 0]))
    assert n == 2


def test_scale_down_one_at_a_time_with_waits_that_shrink_with_the_surplus():
    p = policy(downscale_dwell_s=60, downscale_step_s=5, downscale_headroom=0.8)
    state: dict = {}
    # 5 replicas, 10 requests: 4 replicas would hold 32 at 80%; load is 10/32 of that, so the first
    # removal waits 60 x 10/32 = 18.75 s of headroom.
    for t in (0, 10, 18):
        n, state = p(ctx(5, running=[2] * 5, state=state, now=t))
        assert n == 5
    n, state = p(ctx(5, running=[2] * 5, state=state, now=19))
    assert n == 4
    # The next one waits downscale_step_s x 10/24 = 2.1 s of fresh headroom.
    n, state = p(ctx(4, running=[2.5] * 4, state=state, now=20))
    n, state = p(ctx(4, running=[2.5] * 4, state=state, now=22))
    assert n == 4
    n, state = p(ctx(4, running=[2.5] * 4, state=state, now=23))
    assert n == 3
    # No load at all: no wait, yet still one replica per decision.
    p = policy()
    state = {}
    for target in (10, 9, 8):
        n, state = p(ctx(target, state=state, now=100))
        assert n == target - 1


def test_load_at_the_headroom_waits_the_full_dwell():
    p = policy(downscale_dwell_s=60, downscale_headroom=0.8)
    state: dict = {}
    for t in (0, 59):  # 32 requests = 80% of 4 replicas: right at the headroom
        n, state = p(ctx(5, running=[6.4] * 5, state=state, now=t))
        assert n == 5
    n, state = p(ctx(5, running=[6.4] * 5, state=state, now=60))
    assert n == 4


def test_no_scale_down_without_headroom_and_a_queue_restarts_the_wait():
    p = policy(downscale_dwell_s=60, downscale_headroom=0.8)
    # 33 requests on 5 replicas: 4 would run at 82.5% > 80% -> stay.
    n, state = p(ctx(5, running=[6.6] * 5, now=0))
    n, state = p(ctx(5, running=[6.6] * 5, state=state, now=100))
    assert n == 5
    # Headroom (wait 60 x 10/32 = 18.75 s), then a queue appears before it ends: the wait starts over.
    n, state = p(ctx(5, running=[2] * 5, state=state, now=200))
    n, state = p(ctx(5, running=[2] * 5, handle_queued=0.5, total=10.5, state=state, now=210))
    for t in (211, 229):
        n, state = p(ctx(5, running=[2] * 5, state=state, now=t))
        assert n == 5
    n, state = p(ctx(5, running=[2] * 5, state=state, now=230))
    assert n == 4


def test_no_removal_shortly_after_an_addition():
    # A burst adds replicas; the load is gone a moment later: no reversal within downscale_dwell_s.
    p = policy(downscale_dwell_s=60)
    n, state = p(ctx(2, running=[10, 10], handle_queued=75, now=0))
    assert n == 10
    for t in (1, 30, 59):
        n, state = p(ctx(10, running=[0] * 10, state=state, now=t))
        assert n == 10
    n, state = p(ctx(10, running=[0] * 10, state=state, now=60))
    assert n == 9


def test_no_removal_back_to_a_count_that_had_to_grow():
    # 4 replicas ran 42 (over their capacity of 40) and grew to 5; later 27 requests fit 4 at 70% (28),
    # but 4 was too small for this load: no removal within reversal_guard_s unless demand halves (21).
    p = policy(downscale_dwell_s=10, downscale_headroom=0.7, reversal_guard_s=600)
    n, state = p(ctx(4, running=[10.5] * 4, now=0))
    assert n == 5
    for t in (100, 300, 599):
        n, state = p(ctx(5, running=[5.4] * 5, state=state, now=t))
        assert n == 5
    n, state = p(ctx(5, running=[5.4] * 5, state=state, now=600))
    assert n == 4
    # Demand halved since the rise: the guard lets go at once.
    n, state = p(ctx(4, running=[10.5] * 4, now=0))
    n, state = p(ctx(5, running=[3.0] * 5, state=state, now=100))
    n, state = p(ctx(5, running=[3.0] * 5, state=state, now=120))
    assert n == 4


def test_falling_demand_never_scales_up():
    # A 5.5 s queue wait (11 per replica at 2 req/s) would add replicas, but the system held 40
    # requests 5 s ago and 30 now: the queue drains, so nothing is added.
    p = policy(max_queue_wait_s=2.0)
    _, state = p(ctx(2, running=[4, 4], waiting=[16, 16], finished=[1.0, 1.0], now=0))
    n, _ = p(ctx(2, running=[4, 4], waiting=[11, 11], finished=[1.0, 1.0], now=5, state=state))
    assert n == 2
    # The same queue, steady: replicas are added.
    n, _ = p(ctx(2, running=[4, 4], waiting=[11, 11], finished=[1.0, 1.0], now=5))
    assert n > 2


def test_startup_is_measured_from_ask_to_running():
    p = policy(startup_s=30.0)
    n, state = p(ctx(2, running=[10, 10], handle_queued=75, now=100))
    assert n == 10
    _, state = p(ctx(10, ready=6, running=[10] * 6, handle_queued=35, state=state, now=120))
    assert "iterserve_startup_s" not in state  # not all 10 run yet
    _, state = p(ctx(10, ready=10, running=[9.5] * 10, state=state, now=145))
    assert state["iterserve_startup_s"] == 45.0


def test_saturation_at_max_replicas_is_not_a_start_up():
    # Replicas that run 4 at 1 req/s each (as in the queue-wait test), clamped at max_replicas 2: the
    # policy wants more but no replica has to start, so nothing is measured as a start-up.
    p = policy(max_queue_wait_s=2.0, queue_drain_s=60.0, startup_s=30.0)
    n, state = p(ctx(2, running=[4, 4], waiting=[6, 6], finished=[1.0, 1.0], now=0, hi=2))
    assert n == 2
    n, state = p(ctx(2, running=[4, 4], waiting=[11, 11], finished=[1.0, 1.0], now=5, hi=2, state=state))
    assert n == 2
    assert "iterserve_startup_s" not in state
    # The bound goes up (the operator raised it, or the cluster has room again) with the queue still
    # growing 2 req/s: new replicas find it grown for the configured 30 s start-up, not for one tick:
    # (4 + (32 + 2 x 30) / 60) x 4 / 4 = 5.5 -> 6 (a 5 s "start-up" would give 4.7 -> 5).
    n, state = p(ctx(2, running=[4, 4], waiting=[16, 16], finished=[1.0, 1.0], now=10, state=state))
    assert n == 6
    # A start-up that was measured stays measured through a saturation at the bound.
    p = policy(startup_s=30.0)
    _, state = p(ctx(2, running=[10, 10], handle_queued=75, now=100, hi=10))
    _, state = p(ctx(10, ready=10, running=[10] * 10, handle_queued=40, state=state, now=145, hi=10))
    assert state["iterserve_startup_s"] == 45.0
    for t in (146, 147, 148):
        n, state = p(ctx(10, running=[10] * 10, handle_queued=40, state=state, now=t, hi=10))
        assert n == 10
    assert state["iterserve_startup_s"] == 45.0


def test_growth_lead_sizes_for_demand_a_start_up_ahead():
    # 18 of 20 running and growing 1 req/s: reactive keeps 2 replicas; growth_lead 1 sizes for
    # 18 + 1 x 30 s = 48 -> 5 replicas.
    for lead, expect in ((0.0, 2), (1.0, 5)):
        p = policy(growth_lead=lead, startup_s=30.0)
        _, state = p(ctx(2, running=[6.5, 6.5], now=0))
        n, _ = p(ctx(2, running=[9, 9], now=5, state=state))
        assert n == expect


def test_queue_drain_must_cover_half_the_startup():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="queue_drain_s"):
        QueueDepthPolicy(startup_s=120.0, queue_drain_s=30.0)
    QueueDepthPolicy(startup_s=120.0, queue_drain_s=60.0)


def test_steady_load_inside_the_band_never_moves():
    # Demand wandering between 62 and 80 on 8 replicas (capacity 80; 7 would be 56 at 80%): no change.
    p = policy(downscale_dwell_s=10)
    state: dict = {}
    for t in range(0, 600, 1):
        demand = 71 + 9 * ((t * 7919) % 13 - 6) / 6
        n, state = p(ctx(8, running=[demand / 8] * 8, state=state, now=t))
        assert n == 8


def test_bounds_and_scale_to_zero_by_config():
    p = policy(downscale_dwell_s=10, scale_to_zero_dwell_s=100)
    # min 1: the last replica stays.
    n, state = p(ctx(1, now=0, lo=1))
    n, state = p(ctx(1, now=1000, lo=1, state=state))
    assert n == 1
    # min 0: after the zero dwell with no request at all.
    n, state = p(ctx(1, now=0, lo=0))
    n, state = p(ctx(1, now=99, lo=0, state=state))
    assert n == 1
    n, state = p(ctx(1, now=100, lo=0, state=state))
    assert n == 0
    # max bound holds under any burst.
    n, _ = p(ctx(2, running=[10, 10], handle_queued=1000, hi=6))
    assert n == 6


def test_through_serves_wrapper_no_extra_delay_and_cold_start_from_zero():
    """Serve wraps the policy; with the app's defaults for this policy its delays add nothing."""
    wrapped = _apply_autoscaling_config(policy())
    n, _ = wrapped(ctx(2, running=[10, 10], handle_queued=75))
    assert n == 10
    # Zero replicas and a request waiting at a handle: Serve's cold-start path asks for one.
    n, _ = wrapped(ctx(0, ready=0, handle_queued=3, lo=0))
    assert n == 1
    # Serve's own delays would hold the same burst back (30 s upscale delay).
    slow = _apply_autoscaling_config(policy())
    n, _ = slow(ctx(2, running=[10, 10], handle_queued=75, config=AutoscalingConfig(
        **AppAutoscaling(max_replicas=100, upscale_delay_s=30).to_serve())))
    assert n == 2


def test_plain_function_form_uses_default_knobs():
    n, _ = queue_depth_policy(ctx(1, running=[48], handle_queued=48))
    assert n == 2


def test_the_built_options_leave_the_queue_depth_policy_its_own_timing():
    """The app's autoscaling options, through Serve's wrapper as the controller applies them: every
    decision of the queue-depth policy comes out as the policy made it (its own dwell; no Serve
    delay, factor or smoothing on top), over a burst, the steps down and scale to zero."""
    knobs = {"target_running": T, "downscale_dwell_s": 10, "downscale_step_s": 5, "scale_to_zero_dwell_s": 100}
    auto = llm_deployment_options(load_config({"autoscaling": {"min_replicas": 0, "max_replicas": 8,
                                                               "policy_kwargs": knobs}}))["autoscaling_config"]
    assert auto["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": knobs}
    # The path Serve's controller imports names this class (a stale path fails only at deploy time).
    module, _, name = POLICY_PATH.partition(":")
    assert getattr(importlib.import_module(module), name) is QueueDepthPolicy
    config = AutoscalingConfig(**auto)
    bare, wrapped = QueueDepthPolicy(**knobs), _apply_autoscaling_config(QueueDepthPolicy(**knobs))
    target, bare_state, wrapped_state, decisions = 1, {}, {}, []
    for t in range(400):
        demand = 5 if t < 5 else 60 if t < 30 else 20 if t < 200 else 0
        running = [demand / target] * target if target else []
        n, bare_state = bare(ctx(target, running=running, now=t, lo=0, hi=8, state=bare_state, config=config))
        w, wrapped_state = wrapped(ctx(target, running=running, now=t, lo=0, hi=8, state=wrapped_state,
                                       config=config))
        assert w == n, (t, w, n)
        decisions.append(n)
        target = n
    steps = [b - a for a, b in zip(decisions, decisions[1:]) if b != a]
    assert max(steps) >= 5 and steps.count(-1) >= 3 and decisions[-1] == 0, decisions  # each case was met


def test_serves_policy_selected_keeps_serves_own_timing():
    """Selecting Serve's policy brings back Serve's own delays (those of Serve's defaults, not ours):
    through the wrapper a burst waits, where the queue-depth policy acts at once."""
    auto = llm_deployment_options(load_config({"autoscaling": {"policy": SERVE_POLICY_PATH,
                                                               "max_replicas": 100}}))["autoscaling_config"]
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

    with pytest.raises(ConfigError, match="target_runing"):
        build_app({"autoscaling": {"policy_kwargs": {"target_runing": 3}}})
    with pytest.raises(ConfigError, match="queue_drain_s"):
        build_app({"autoscaling": {"policy_kwargs": {"startup_s": 300, "queue_drain_s": 30}}})
    with pytest.raises(ConfigError, match="growth_lead"):
        build_app({"autoscaling": {"policy_kwargs": {"growth_lead": -1}}})
