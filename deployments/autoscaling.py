"""Queue-depth autoscaling for LLM replicas: the policy Serve's controller calls every control tick.

Serve wraps every policy (its own too) with `_apply_autoscaling_config`: scaling factors, then
`upscale_delay_s` / `downscale_delay_s`, then min/max bounds. This policy keeps its own timing (the
waits before each removal), so the app sets those delays to 0 and the factors to 1 for it.

What it decides from, per replica (LLMServer.record_autoscaling_stats, averaged over the look-back):
`running`, `waiting` (in the engine), `kv_usage`; and from the counters' raw series, `finished` and
`preemptions` per second. From the callers' handles: `total_num_requests` (running + queued) and
`total_queued_requests` (queued at handles, no replica yet).

    queue     = requests waiting in engines + queued at handles; expected wait = queue / completions per s
    capacity  = target_running sequences per replica, running and starting ones alike (capacity on the
                way: a burst is not counted twice while its replicas start); a replica whose KV cache
                is full or that preempted counts only what it runs now (it admits no more)
    start-up  = measured from an ask for replicas that must start to their running (+ warmup_s);
                startup_s until measured
    up        : running sequences over capacity -> straight to the count that covers them; and when
                the expected wait exceeds max_queue_wait_s and demand is not falling, enough replicas
                for the arrival rate (completions + growth of the queue) plus draining a backlog within
                queue_drain_s, at the measured service time (Little: running / completions per s).
                The backlog is the one the new replicas will find: the queue plus its growth until
                they run, re-estimated each tick of the first queue_drain_s of a rise (replicas
                asked later land after it is drained)
    draining  : while the queue shrinks (replicas that just landed took it up), neither rule adds
                replicas: they run full by design until it is gone
    lead      : growth_lead > 0 sizes for demand extrapolated over that share of the start-up time
    down      : one replica per decision, only when the fleet without it keeps headroom (requests under
                downscale_headroom of the smaller fleet's capacity, nothing queued, no KV pressure),
                never within downscale_dwell_s of an addition (no reversal on a burst's tail) nor, for
                reversal_guard_s, back to a count that had to grow unless demand has halved since
                (steady load does not cycle). The wait
                (downscale_dwell_s for the first removal after a rise, downscale_step_s for the next)
                shrinks with how far load is below that headroom: a fleet twice too big empties fast
    zero      : with min_replicas 0, the last replica leaves after scale_to_zero_dwell_s with no
                request at all; requests that arrive then wait at the handles while Serve's cold start
                path brings one replica back
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

POLICY_PATH = "deployments.autoscaling:QueueDepthPolicy"
SERVE_POLICY_PATH = "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"

# Metric names LLMServer.record_autoscaling_stats reports.
RUNNING, WAITING, KV_USAGE, FINISHED, PREEMPTIONS = "running", "waiting", "kv_usage", "finished", "preemptions"
_LOW_SINCE = "iterserve_low_since"  # policy_state: when the fleet last started having headroom
_STEPPING = "iterserve_stepping_down"  # policy_state: a removal happened since the last rise
_HISTORY = "iterserve_demand"  # policy_state: recent (time, requests in the system, queued), for growth rates
_LAST_UP = "iterserve_last_up"  # policy_state: when replicas were last added
_ASK = "iterserve_ask"  # policy_state: (time, count) of the oldest ask for replicas to start, not yet running
_STARTUP = "iterserve_startup_s"  # policy_state: measured start-up seconds
_RISE = "iterserve_rise"  # policy_state: when the replicas now starting were first asked for
_TOO_SMALL = "iterserve_too_small"  # policy_state: (time, count, demand) of the last fleet that had to grow


class QueueDepthPolicyConfig(BaseModel):
    """The policy's knobs (`autoscaling.policy_kwargs`). Defaults fit the embedded model's config
    (max_num_seqs 64 on 2 CPU cores)."""

    model_config = ConfigDict(extra="forbid")

    target_running: float = Field(
        48.0, gt=0, description="Sequences per replica the fleet is sized for (0.75 x max_num_seqs: "
        "room for a burst to land while new replicas start).")
    max_queue_wait_s: float = Field(
        2.0, gt=0, description="Expected queue wait (queued / measured completions per second) above "
        "which replicas are added for the arrival rate plus draining the queue.")
    queue_drain_s: float = Field(
        30.0, gt=0, description="Time a backlog should take to drain once replicas are added: shorter "
        "buys more replicas for a backlog that is gone once they start. At least half of startup_s.")
    startup_s: float = Field(
        30.0, gt=0, description="Replica start-up time (ask to running) used until one is measured.")
    warmup_s: float = Field(
        0.0, ge=0, description="Seconds a running replica needs before it serves at full speed (added "
        "to the measured start-up time).")
    growth_lead: float = Field(
        0.0, ge=0, description="Size for demand extrapolated at its current growth over this share of "
        "the start-up time (0: off, purely reactive).")
    kv_high: float = Field(0.9, gt=0, le=1, description="KV usage at which a replica counts as full.")
    downscale_headroom: float = Field(
        0.7, gt=0, le=1, description="Remove a replica only if demand stays under this share of the "
        "smaller fleet's capacity (the band between up and down stops oscillation).")
    downscale_dwell_s: float = Field(
        60.0, ge=0, description="No removal this soon after an addition; also the headroom held before "
        "the first removal after a rise (shorter the further load is below the headroom).")
    downscale_step_s: float = Field(5.0, ge=0, description="Headroom held before each further removal "
                                    "(one replica each; shorter the further load is below the headroom).")
    reversal_guard_s: float = Field(
        600.0, ge=0, description="After a fleet of N replicas had to grow, no removal back to N for this "
        "long unless demand has halved since: near saturation, running sequences fall as replicas are "
        "added (faster steps), so a fleet that looks roomy would be too small again one replica down.")
    scale_to_zero_dwell_s: float = Field(
        300.0, ge=0, description="No request at all for this long before the last replica leaves "
        "(only with min_replicas 0).")

    @model_validator(mode="after")
    def _drain_fits_startup(self) -> "QueueDepthPolicyConfig":
        # A backlog drained much faster than replicas start buys replicas that arrive to an empty queue.
        if self.queue_drain_s < self.startup_s / 2:
            raise ValueError(f"queue_drain_s ({self.queue_drain_s}) must be >= startup_s / 2 ({self.startup_s / 2})")
        return self


def _rate(series) -> Optional[float]:
    """Per-second increase of a cumulative counter over its raw window (None when under 1 s)."""
    if not series or len(series) < 2:
        return None
    first, last = series[0], series[-1]
    span = last.timestamp - first.timestamp
    return max(0.0, last.value - first.value) / span if span >= 1.0 else None


def _replicas_for(load: float, per_replica: float) -> int:
    return math.ceil(load / per_replica - 1e-9)


class QueueDepthPolicy:
    """`policy: deployments.autoscaling:QueueDepthPolicy`; Serve instantiates it once with policy_kwargs
    and calls it with an AutoscalingContext each control tick."""

    def __init__(self, **policy_kwargs: Any):
        self.cfg = QueueDepthPolicyConfig(**policy_kwargs)

    def __call__(self, ctx) -> Tuple[int, Dict[str, Any]]:
        c = self.cfg
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        target, ready = ctx.target_num_replicas, ctx.current_num_replicas
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        starting = max(0, target - ready)
        startup = self._startup(state, now, target, ready) + c.warmup_s

        metrics = ctx.aggregated_metrics or {}
        raw = ctx.raw_metrics or {}
        running, waiting, kv = metrics.get(RUNNING, {}), metrics.get(WAITING, {}), metrics.get(KV_USAGE, {})
        queued = sum(waiting.values()) + (ctx.total_queued_requests or 0.0)
        in_flight = sum(running.values())
        # Handles see every request; the replicas' own reports are a floor (a caller without metrics).
        demand = max(ctx.total_num_requests or 0.0, in_flight + queued)
        growth, queue_growth = self._growth(state, now, demand, queued)
        # A queue that shrinks is being drained (new replicas took it up, or completions outpace
        # arrivals): replicas run full by design until it is gone, and neither rule below adds any.
        draining = queued > 0 and queue_growth < 0

        pressured = {r for r in ctx.running_replicas
                     if kv.get(r, 0.0) >= c.kv_high or (_rate(raw.get(PREEMPTIONS, {}).get(r)) or 0.0) > 0}
        capacity = sum(min(running.get(r, 0.0), c.target_running) if r in pressured else c.target_running
                       for r in ctx.running_replicas)
        capacity += starting * c.target_running

        desired = target
        # What runs now (or, with growth_lead, what will run by the time new replicas do) over capacity:
        # straight to the count that covers it.
        ahead = in_flight + c.growth_lead * max(0.0, growth) * startup
        if ahead > capacity and not draining:
            desired = target + _replicas_for(ahead - capacity, c.target_running)
        # Replicas with a measured completion rate (a replica that just started has none yet).
        measured = {r: x for r in ctx.running_replicas if (x := _rate(raw.get(FINISHED, {}).get(r))) is not None}
        completions = sum(measured.values())
        busy = sum(running.get(r, 0.0) for r in measured)
        if queued > 0 and growth >= 0 and not draining:  # falling demand adds nothing
            if completions > 0 and busy > 0:
                if queued / completions > c.max_queue_wait_s:
                    service_s = busy / completions  # Little's law, per request on a replica
                    arrivals = completions + growth
                    # Replicas that queue below target_running (long prompts, KV) run what they run.
                    per_replica = min(c.target_running, busy / len(measured))
                    # The backlog to drain is the one there will be when the replicas asked for run:
                    # today's queue plus its growth until then (re-estimated every tick, not added
                    # up). Replicas asked later than queue_drain_s into a rise land after the first
                    # ones have drained it: they are asked for the arrival rate only.
                    rise = state.get(_RISE) if starting else None
                    since = now - rise if rise is not None else 0.0
                    backlog = ((queued + queue_growth * max(0.0, startup - since)) / c.queue_drain_s
                               if since < c.queue_drain_s else 0.0)
                    need = (arrivals + backlog) * service_s / per_replica
                    desired = max(desired, _replicas_for(need, 1.0))
            elif demand > capacity:  # nothing measured yet (a first burst): count the queue as load
                desired = max(desired, target + _replicas_for(demand - capacity, c.target_running))

        if desired > target:
            state[_LAST_UP], state[_TOO_SMALL] = now, (now, target, demand)
            if not starting:
                state[_RISE] = now
            asked = min(desired, hi)
            # Only replicas that must start time a start-up: clamped at max_replicas, the count asked
            # for already runs, and the next tick would "measure" one tick and shrink the backlog.
            if state.get(_ASK) is None and asked > max(target, ready):
                state[_ASK] = (now, asked)
        if desired > target or queued > 0 or pressured:
            state[_LOW_SINCE], state[_STEPPING] = None, False
        else:
            desired = self._maybe_step_down(target, demand, lo, now, state)
        return max(lo, min(hi, desired)), state

    def _startup(self, state: dict, now: float, target: int, ready: int) -> float:
        """Start-up seconds: the configured value until an ask has been seen through to running."""
        ask = state.get(_ASK)
        if ask is not None:
            asked_at, count = ask
            if ready >= min(count, target):  # all asked for run (or the ask was cut back)
                if ready >= count:
                    state[_STARTUP] = now - asked_at
                state[_ASK] = None
        return state.get(_STARTUP) or self.cfg.startup_s

    @staticmethod
    def _growth(state: dict, now: float, demand: float, queued: float, span_s: float = 5.0) -> Tuple[float, float]:
        """Requests per second the system (arrivals beyond what completes) and the queue gained over
        the last ~span_s."""
        # (An entry of another shape is from an earlier version of this policy: dropped.)
        history = [h for h in state.get(_HISTORY, []) if len(h) == 3 and now - h[0] <= 2 * span_s]
        history.append((now, demand, queued))
        state[_HISTORY] = history
        old = [h for h in history if now - h[0] >= span_s]
        t0, d0, q0 = old[-1] if old else history[0]
        return ((demand - d0) / (now - t0), (queued - q0) / (now - t0)) if now > t0 else (0.0, 0.0)

    def _maybe_step_down(self, target: int, demand: float, lo: int, now: float, state: dict) -> int:
        c = self.cfg
        smaller = target - 1
        if smaller < lo:
            state[_LOW_SINCE] = None
            return target
        room = c.downscale_headroom * smaller * c.target_running
        fits = demand <= 0 if smaller == 0 else demand <= room
        if not fits:
            state[_LOW_SINCE] = None
            return target
        since = state.get(_LOW_SINCE)
        if since is None:
            state[_LOW_SINCE] = since = now
        if smaller == 0:
            dwell = c.scale_to_zero_dwell_s
        else:
            # Load at the headroom waits the full time; a fleet far too big for its load steps faster.
            dwell = (c.downscale_step_s if state.get(_STEPPING) else c.downscale_dwell_s) * demand / room
        last_up = state.get(_LAST_UP)
        if last_up is not None and now - last_up < c.downscale_dwell_s:
            return target  # no removal right after an addition: that would be a reversal
        too_small = state.get(_TOO_SMALL)
        if (too_small is not None and smaller <= too_small[1] and now - too_small[0] < c.reversal_guard_s
                and demand > 0.5 * too_small[2]):
            return target  # back to a count that proved too small for about this load: it would reverse
        if now - since >= dwell:
            state[_LOW_SINCE], state[_STEPPING] = None, True  # the next removal re-checks on fresh metrics
            return smaller
        return target


def queue_depth_policy(ctx) -> Tuple[int, Dict[str, Any]]:
    """The policy with its default knobs, as a plain function (Serve passes no kwargs to functions)."""
    return _DEFAULT(ctx)


_DEFAULT = QueueDepthPolicy()
