"""Queue-depth autoscaling for LLM replicas: the policy Serve's controller calls every control tick.

Serve wraps every policy (its own too) with `_apply_autoscaling_config`: scaling factors, then
`upscale_delay_s` / `downscale_delay_s`, then min/max bounds. This policy keeps its own timing (the
dwell before each removal), so the app sets those delays to 0 and the factors to 1 for it.

What it decides from, per replica (LLMServer.record_autoscaling_stats, averaged over the look-back):
`running`, `waiting` (in the engine), `kv_usage`; and from the counters' raw series, `finished` and
`preemptions` per second. From the callers' handles: `total_num_requests` (running + queued) and
`total_queued_requests` (queued at handles, no replica yet).

    demand    = requests in the system (running + waiting in engines + queued at handles)
    capacity  = target_running per replica, running ones and starting ones alike (capacity on the
                way: a burst is not counted twice while its replicas start); a replica whose KV cache
                is full or that preempted counts only what it runs now (it admits no more)
    up        : demand > capacity -> straight to the count that covers it (no per-step ramp);
                and when the queue's expected wait (queue / measured completions per second) exceeds
                max_queue_wait_s -> enough replicas to bring that wait back under it
    down      : one replica at a time, only when the fleet without it keeps headroom (demand under
                downscale_headroom of the smaller fleet's capacity, nothing queued, no KV pressure)
                for downscale_dwell_s in a row; the dwell restarts after each removal and each rise
    zero      : with min_replicas 0, the last replica leaves after scale_to_zero_dwell_s with no
                request at all; requests that arrive then wait at the handles while Serve's cold start
                path brings one replica back
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field

POLICY_PATH = "cluster.autoscaling:QueueDepthPolicy"
SERVE_POLICY_PATH = "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"

# Metric names LLMServer.record_autoscaling_stats reports.
RUNNING, WAITING, KV_USAGE, FINISHED, PREEMPTIONS = "running", "waiting", "kv_usage", "finished", "preemptions"
_LOW_SINCE = "iterserve_low_since"  # policy_state key: when the fleet first had headroom without one replica


class QueueDepthPolicyConfig(BaseModel):
    """The policy's knobs (`autoscaling.policy_kwargs`). Defaults fit the embedded model's config
    (max_num_seqs 64 on 2 CPU cores)."""

    model_config = ConfigDict(extra="forbid")

    target_running: float = Field(
        48.0, gt=0, description="Sequences per replica the fleet is sized for (0.75 x max_num_seqs: "
        "room for a burst to land while new replicas start).")
    max_queue_wait_s: float = Field(
        2.0, gt=0, description="Expected queue wait (queued / measured completions per second) above "
        "which replicas are added to bring it back under.")
    kv_high: float = Field(0.9, gt=0, le=1, description="KV usage at which a replica counts as full.")
    downscale_headroom: float = Field(
        0.8, gt=0, le=1, description="Remove a replica only if demand stays under this share of the "
        "smaller fleet's capacity (the band between up and down stops oscillation).")
    downscale_dwell_s: float = Field(60.0, ge=0, description="Headroom held this long before each removal.")
    scale_to_zero_dwell_s: float = Field(
        300.0, ge=0, description="No request at all for this long before the last replica leaves "
        "(only with min_replicas 0).")


def _rate(series) -> Optional[float]:
    """Per-second increase of a cumulative counter over its raw window (None when under 1 s)."""
    if not series or len(series) < 2:
        return None
    first, last = series[0], series[-1]
    span = last.timestamp - first.timestamp
    return max(0.0, last.value - first.value) / span if span >= 1.0 else None


class QueueDepthPolicy:
    """`policy: cluster.autoscaling:QueueDepthPolicy`; Serve instantiates it once with policy_kwargs
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

        metrics = ctx.aggregated_metrics or {}
        raw = ctx.raw_metrics or {}
        running, waiting, kv = metrics.get(RUNNING, {}), metrics.get(WAITING, {}), metrics.get(KV_USAGE, {})
        queued = sum(waiting.values()) + (ctx.total_queued_requests or 0.0)
        # Handles see every request; the replicas' own reports are a floor (a caller without metrics).
        demand = max(ctx.total_num_requests or 0.0, sum(running.values()) + queued)

        pressured = {r for r in ctx.running_replicas
                     if kv.get(r, 0.0) >= c.kv_high or (_rate(raw.get(PREEMPTIONS, {}).get(r)) or 0.0) > 0}
        capacity = sum(min(running.get(r, 0.0), c.target_running) if r in pressured else c.target_running
                       for r in ctx.running_replicas)
        capacity += starting * c.target_running

        desired = target
        if demand > capacity:  # a burst goes straight to the count that covers it
            desired = target + math.ceil((demand - capacity) / c.target_running - 1e-9)
        rates = [_rate(raw.get(FINISHED, {}).get(r)) for r in ctx.running_replicas]
        per_replica = [x for x in rates if x is not None]
        if queued > 0 and per_replica and sum(per_replica) > 0:
            # Expected wait once the starting replicas serve too (each at the measured mean rate).
            fleet_rate = sum(per_replica) / len(per_replica) * max(target, 1)
            wait = queued / fleet_rate
            if wait > c.max_queue_wait_s:
                desired = max(desired, math.ceil(max(target, 1) * wait / c.max_queue_wait_s))

        if desired > target or queued > 0 or pressured:
            state[_LOW_SINCE] = None
        else:
            desired = self._maybe_step_down(target, demand, lo, now, state)
        return max(lo, min(hi, desired)), state

    def _maybe_step_down(self, target: int, demand: float, lo: int, now: float, state: dict) -> int:
        c = self.cfg
        smaller = target - 1
        if smaller < lo:
            state[_LOW_SINCE] = None
            return target
        fits = demand <= 0 if smaller == 0 else demand <= c.downscale_headroom * smaller * c.target_running
        if not fits:
            state[_LOW_SINCE] = None
            return target
        since = state.get(_LOW_SINCE)
        if since is None:
            state[_LOW_SINCE] = since = now
        dwell = c.scale_to_zero_dwell_s if smaller == 0 else c.downscale_dwell_s
        if now - since >= dwell:
            state[_LOW_SINCE] = None  # the next removal waits a whole dwell again
            return smaller
        return target


def queue_depth_policy(ctx) -> Tuple[int, Dict[str, Any]]:
    """The policy with its default knobs, as a plain function (Serve passes no kwargs to functions)."""
    return _DEFAULT(ctx)


_DEFAULT = QueueDepthPolicy()

