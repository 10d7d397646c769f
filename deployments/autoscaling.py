"""The LLM replicas' autoscaling policy: Serve's controller calls it every control tick.

Two knobs, the TTFT SLO (`slo_s`) and the replica start-up time (`startup_s`, only until one is
measured); the rest is measured from the replicas or derived from those two (docs/autoscaling.md):

    measured  the start-up (ask -> all running); mu, the completions per second of a full replica
              (requests wait in its engine, or at the handles while it runs 90% of its slots, or its
              KV cache is full) once it has been full a look-back plus a request's latency, averaged
              over a start-up of full seconds; until one was full, what replicas report they would
              complete full (capacity: their measured step times at their requests' size), else the
              highest median completion rate seen, averaged over a memory bucket (a floor); the
              replica's slots (from the engine config via the app, else the most it ran while
              requests queued)
    rate      arrivals = completions + growth of the requests in the system over ~5 s, averaged over
              a memory bucket; a ramp (up in 5 of the last 6 buckets, at most doubling) is projected
              one start-up ahead, when replicas asked now land
    need      the fewest replicas with under queueing.MISS of requests waiting past the SLO (M/M/c
              over the slots), and the running requests at the slots with a sqrt-staffing margin; the larger
    burst     a queue that would outlast a start-up at its pace: the arrival rate plus draining the
              queue now within one start-up (not its projection: a burst may end before replicas land);
              not while the queues of the memory have been ending within a start-up (a median spell)
              and this one has not outlasted them
    memory    arrivals (the measured rate, not its smoothed estimate) and running requests per
              bucket of start-up/6 s, over the last MEMORY_STARTUPS start-ups, as load (a better mu
              resizes them); a bucket needed the rate that kept its queue within the SLO
              (burst_capacity: a 10 s burst 10/11 of its rate, a held rate all of it). A count of
              replicas is kept while some bucket needed it within the last start-up (rent or buy:
              keeping an idle replica one start-up costs what re-buying it does; while the memory
              is younger than its span, YOUNG_HOLD start-ups for a burst shorter than a start-up,
              which reacting cannot serve) or, for a count demand keeps
              returning to after lulls (under half of it in between), while the silence since its
              last visit is under RECUR_GAPS mean gaps between visits plus a start-up: a lull shorter
              than the recurrence keeps the capacity, a longer silence is a trend and releases it.
              Replicas asked for, and the fleet found at the first call, are kept a start-up
    down      straight to the kept count, but only as far as DOWN_HEADROOM (30%) more load would
              still need (a band: a need flickering at a threshold, or a rate rising again within a
              start-up, holds the higher count instead of buying it back too late) at the
              highest of the arrivals now and over the last half start-up's buckets (a dip of a
              bucket or two is not a drop), and not by less than
              max(1, sqrt(n) / 2) (noise) unless that halves the fleet
    up        at once, except by less than sqrt(n) / 2 with nothing queued and no ramp adding a
              replica (noise too)
"""

from __future__ import annotations

import math
import time
from statistics import median
from typing import Any, Dict, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments import demand_memory
from deployments.demand_memory import BUCKETS_PER_STARTUP
from deployments.queueing import burst_capacity, ceil, rate_per_s, replicas_within_slo

POLICY_PATH = "deployments.autoscaling:QueueDepthPolicy"
SERVE_POLICY_PATH = "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"

# Metric names LLMServer.record_autoscaling_stats reports.
RUNNING, WAITING, KV_USAGE, FINISHED, PREEMPTIONS = "running", "waiting", "kv_usage", "finished", "preemptions"
CAPACITY = "capacity"  # req/s a replica estimates it completes full (router.cost_model.StepMeter.capacity)
KV_FULL = 0.9  # KV usage at which a replica admits no more (the engine's watermark)
RECUR_GAPS = 3.0  # a recurring level is released after a silence of this many mean gaps between visits
KEEP_TOLERANCE = 0.1  # running requests within 10% of a level neither keep nor release it (Knative's and AIBrix's band)
# Going down, a fleet keeps room for this much more load than now: a replica given back is a start-up
# away, and a production trace's 10 s rate rises by about that within a start-up (azure_conv_2023:
# the highest bucket of the next minute is a median 1.18x, upper quartile 1.33x the bucket's rate).
DOWN_HEADROOM = 1.3
# A drop counts once it has held half a start-up (3 buckets at 60 s): the 10 s rate of smooth production
# traffic dips for a bucket or two and comes back (azure_conv_2023: the fleet stepped down in such dips
# and met the return with a queue for a start-up; over ten simulated seeds, 3 buckets left one under
# Serve's default + 5 points, 1 bucket two: docs/autoscaling.md).
DROP_BUCKETS = BUCKETS_PER_STARTUP // 2
# While the memory is young nothing says whether a burst recurs. A burst over before the replicas
# bought for it land (out of a lull and back within a start-up) is load reacting cannot serve: it is
# kept this many start-ups (Serve's default keeps every level 600 s, 10 at 60 s; azure_code's bursts
# recur a median 200 s, upper quartile 490 s apart). Longer load is re-bought like the first time.
YOUNG_HOLD = 10.0
FULL_SHARE = 0.9  # with requests queued at the handles, a replica running this share of its slots is full

# Knob names of the 13-knob version: named in the error so a stale config says what replaced it.
REMOVED_KNOBS = (
    "target_running",
    "max_queue_wait_s",
    "queue_drain_s",
    "warmup_s",
    "growth_lead",
    "kv_high",
    "downscale_headroom",
    "downscale_dwell_s",
    "downscale_step_s",
    "reversal_guard_s",
    "scale_to_zero_dwell_s",
)
_S = "iterserve"  # policy_state keys: one dict under this name


class QueueDepthPolicyConfig(BaseModel):
    """The policy's knobs (`autoscaling.policy_kwargs`): the SLO and the start-up time, no more."""

    model_config = ConfigDict(extra="forbid")

    slo_s: float = Field(1.0, gt=0, description="Time-to-first-token SLO the fleet is sized for.")
    startup_s: float = Field(30.0, gt=0, description="Replica start-up (ask to running) used until one is measured.")

    @model_validator(mode="before")
    @classmethod
    def _removed_knobs(cls, data: Any) -> Any:
        old = sorted(set(data) & set(REMOVED_KNOBS)) if isinstance(data, dict) else []
        if old:
            raise ValueError(
                f"{', '.join(old)}: removed; the policy takes only slo_s and startup_s "
                "(the rest is measured or derived, docs/autoscaling.md)"
            )
        return data


class QueueDepthPolicy:
    """`policy: deployments.autoscaling:QueueDepthPolicy`; Serve instantiates it once with policy_kwargs
    and calls it with an AutoscalingContext each control tick. `replica_slots` (sequences a replica
    runs at once) is set by the app from the engine config, not by users; measured when absent."""

    def __init__(self, replica_slots: Optional[float] = None, **policy_kwargs: Any):
        self.cfg = QueueDepthPolicyConfig(**policy_kwargs)
        self.replica_slots = replica_slots

    def __call__(self, ctx) -> Tuple[int, Dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        s = dict(state.get(_S) or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        target, ready = ctx.target_num_replicas, ctx.current_num_replicas
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        startup = self._startup(s, now, target, ready)

        metrics, raw = ctx.aggregated_metrics or {}, ctx.raw_metrics or {}
        running, waiting, kv = metrics.get(RUNNING, {}), metrics.get(WAITING, {}), metrics.get(KV_USAGE, {})
        handle_queued = ctx.total_queued_requests or 0.0
        queued = sum(waiting.values()) + handle_queued
        in_flight = sum(running.values())
        demand = max(ctx.total_num_requests or 0.0, in_flight + queued)
        growth, queue_growth = demand_memory.growth(s, now, demand, queued)
        rates = {r: x for r in ctx.running_replicas if (x := rate_per_s(raw.get(FINISHED, {}).get(r))) is not None}
        completions = sum(rates.values())
        raw_arrivals = max(0.0, completions + growth)
        bucket = startup / BUCKETS_PER_STARTUP  # the memory's resolution, and what rates are averaged over
        arrivals = demand_memory.smoothed(s, now, raw_arrivals, bucket, "arrivals")
        if demand <= 0:  # nobody in the system over the look-back: the average's tail is no load
            s["arrivals"], arrivals = (now, 0.0), 0.0

        if rates and completions > 0:  # without a capacity reported, replicas do at least what they did
            # Over a bucket, not a look-back: while the system drains, replicas that stop prefilling
            # finish their requests faster than they sustain for a few seconds (azure_conv: 18.9/s
            # read where full replicas measured 15.0, and the fleet ran a fifth short).
            done = demand_memory.smoothed(s, now, median(rates.values()), bucket, "mu_seen")
            s["mu_floor"] = max(s.get("mu_floor") or 0.0, done)
        # What replicas estimate from their step times and their requests' size: mu until one has
        # been full, and its prior. Not the floor: drains read it high even over a bucket (MMPP: 14.3
        # req/s where a full replica does 13.0), a fleet that never fills low (azure_conv: 12.2-12.8).
        capacities = [x for x in metrics.get(CAPACITY, {}).values() if x > 0]
        if capacities:
            s["capacity"] = median(capacities)

        # Full replicas: their completion rate is what a replica can do (mu); their running count
        # is its slots.
        slots = self.replica_slots or s.get("slots")
        full = [
            r
            for r in ctx.running_replicas
            if waiting.get(r, 0.0) > 0
            or kv.get(r, 0.0) >= KV_FULL
            or (rate_per_s(raw.get(PREEMPTIONS, {}).get(r)) or 0.0) > 0
            or (handle_queued > 0 and running.get(r, 0.0) >= FULL_SHARE * (slots or 0.0))
        ]
        # A replica's completions lag its admissions by a request's latency (Little: running / rate):
        # until it has been full that long plus a look-back, its rate is a ramp into the load, not a
        # full replica's (counted from the replica's start instead, a replica that turned full a
        # second ago read its idle seconds too: mu came out at half what replicas do).
        first = "full_since" not in s  # replicas full at the first call count as settled
        full_since = {r: t for r, t in (s.get("full_since") or {}).items() if r in full}
        for r in full:
            full_since.setdefault(r, now - 1e9 if first else now)
        s["full_since"] = full_since
        look_back = ctx.config.look_back_period_s if ctx.config else 30.0
        settled = {
            r
            for r, x in rates.items()
            if x > 0 and r in full_since and now - full_since[r] >= look_back + running.get(r, 0.0) / x
        }
        self._measure(
            s,
            now,
            startup,
            look_back,
            [rates[r] for r in full if r in settled],
            [running.get(r, 0.0) for r in full] if handle_queued > 0 else [],
        )
        mu = s.get("mu") or s.get("capacity") or s.get("mu_floor")
        slots = self.replica_slots or s.get("slots")

        # With a rate known, a queue is the burst rule's (a queue of thousands over slots would buy
        # replicas for requests that are served before they land); before, it counts as load.
        load = in_flight if mu else demand
        need = self._need(arrivals + demand_memory.trend(s, startup), load, mu, slots)
        s.setdefault("seed", (now, target))  # the fleet found at the first call: kept a start-up too
        # The memory holds each bucket's mean measured rate, not the smoothed one: smoothed over a
        # bucket, a 10 s burst reads at a fraction of its rate and the level kept for it is too low.
        demand_memory.remember(s, now, startup, raw_arrivals if demand > 0 else 0.0, load)
        demand_memory.queue_spells(s, now, startup, queued)
        desired = need
        if mu and queued > 0 and queued + queue_growth * startup > 0 and demand_memory.queues_outlast(s, now, startup):
            # A backlog that would outlast a start-up at its current pace: drain it within one
            # start-up on top of the arrival rate (re-estimated every tick from the queue now, not its
            # projection: a burst may end before the replicas land). Not where queues have been
            # ending within a start-up (bursts): replicas bought for them land after the queue.
            desired = max(desired, self._need(arrivals + queued / startup, 0.0, mu, None))
        # Noise in what a fleet of n needs is about sqrt(n) (Poisson): a change under half of that is
        # not one, either way (a whole replica at least).
        noise = max(1.0, math.sqrt(target) / 2)
        if desired < target:
            # A band, not a line: going down only as far as DOWN_HEADROOM more load would still need (else
            # a need flickering at a threshold, or a rate that rises again within a start-up, buys the
            # replicas back a start-up later, too late). The trend is read again: remember() may have
            # closed a bucket since (the real-Serve burst test needs it).
            # The arrival estimate (completions + growth) dips while a backlog drains and replicas
            # leave, and the rate itself dips for a bucket or two: a drop counts once the last
            # DROP_BUCKETS whole buckets saw it too.
            seen = max([arrivals] + [b[1] for b in s["memory"][-DROP_BUCKETS - 1 : -1]])
            desired = max(
                desired,
                min(
                    target,
                    self._need(
                        (seen + demand_memory.trend(s, startup)) * DOWN_HEADROOM, load * DOWN_HEADROOM, mu, slots
                    ),
                ),
            )
            desired = max(desired, self._kept(s, now, startup, target, mu, slots))
            if target - desired < noise and desired > target / 2:  # halving the fleet is never noise
                desired = target
            if desired == 0 and target > 1:
                desired = 1  # to zero only from one replica, as Serve's wrapper allows
        elif 0 < desired - target < noise and queued <= 0 and need == self._need(arrivals, load, mu, slots):
            desired = target  # a rise within the noise: nothing waits and no ramp adds a replica
        if desired > target:  # a replica asked for is bought: kept at least a start-up
            s["bought"] = (now, min(desired, hi))
        if desired > max(target, ready) and s.get("ask") is None and min(desired, hi) > max(target, ready):
            s["ask"] = (now, min(desired, hi))
        state[_S] = s
        return max(lo, min(hi, desired)), state

    def _need(self, arrivals: float, demand: float, mu: Optional[float], slots: Optional[float]) -> int:
        """Replicas for `arrivals` per second at the SLO's utilization and for `demand` requests in the
        system at `slots` per replica with a sqrt-staffing margin (Halfin-Whitt, beta 1)."""
        n = 0
        if mu and arrivals > 0:
            n = replicas_within_slo(round(arrivals, 3), mu, slots or 0, self.cfg.slo_s)
        if slots and demand > 0:
            n = max(n, ceil((demand + math.sqrt(demand)) / slots))
        if not mu and not slots and demand > 0:
            n = max(n, 1)  # nothing measured yet: the queue rule (backlog) and Serve's cold start act
        return n

    @staticmethod
    def _measure(
        s: dict, now: float, startup: float, look_back: float, full_rates: List[float], full_running: List[float]
    ) -> None:
        """mu: the median completion rate of full replicas, averaged over about a start-up of their
        full seconds (a replica that turns full mid-window reads low, one that drains a backlog of
        prefilled requests high)."""
        if full_running:
            s["slots"] = max(s.get("slots") or 0.0, max(full_running))
        if full_rates:
            # A reading weighs the seconds it adds (at most a look-back, not the time since the last:
            # one drain's reading after a lull replaced mu); the first, from the replicas' estimate.
            mu_now, mu = median(full_rates), s.get("mu") or s.get("capacity")
            if mu_now > 0:
                seconds = min(max(0.0, now - s.get("mu_t", -math.inf)), look_back)
                a = 1.0 if not mu else 1.0 - math.exp(-seconds / startup)
                s["mu"] = (mu or 0.0) + a * (mu_now - (mu or 0.0))
            s["mu_t"] = now

    def _kept(self, s: dict, now: float, startup: float, below: int, mu, slots) -> int:
        """The highest level (at most `below`) demand will likely need again within a start-up: needed
        within the last start-up (a young memory's burst, within YOUNG_HOLD), or a level demand keeps
        returning to (more than one visit in the memory) while the silence since its last visit is
        under RECUR_GAPS mean gaps between visits."""
        floor = 0
        for t, n in (s["seed"], s.get("bought") or (-math.inf, 0)):
            if now - t <= startup:
                floor = max(floor, min(below, n))
        mem = s.get("memory", [])
        width = startup / BUCKETS_PER_STARTUP
        # A bucket needed the capacity that kept its queue within the SLO (burst_capacity); its
        # running requests, only where more than KEEP_TOLERANCE over a level (load that flickers at a
        # threshold never holds a replica).
        keep = 1.0 - KEEP_TOLERANCE
        capacity = burst_capacity([a for _, a, _, _ in mem], width, self.cfg.slo_s, BUCKETS_PER_STARTUP)
        needs = [(t, self._need(c, d * keep, mu, slots)) for (t, _, d, _), c in zip(mem, capacity)]
        young = now - s["seed"][0] < demand_memory.MEMORY_STARTUPS * startup  # no history yet
        for level in range(min(below, max((n for _, n in needs), default=0)), floor, -1):
            # Visits of the level, the gaps between them in which demand fell to under half of it (a
            # lull; a need flickering around the level is one visit), and when the last visit's load
            # rose out of a lull (a burst's level is needed only at its end, when its queue would
            # outlast the SLO).
            last, low, gaps, rose, began, lull = None, math.inf, [], None, None, level / 2
            for t, n in needs:
                rose = None if n < lull else (t if rose is None else rose)
                if n >= level:
                    if last is not None and low < lull:
                        gaps.append(t - last)
                    last, low, began = t, math.inf, rose
                else:
                    low = min(low, n)
            age = now - last - width  # from the end of its last bucket
            # Rent or buy: a replica kept idle one start-up costs what re-buying it does; a young
            # memory's burst, YOUNG_HOLD start-ups (a backlog's drain into a held rate is none).
            burst = last + width - began < startup and low < lull
            if age <= (YOUNG_HOLD if young and burst else 1.0) * startup:
                return level
            if gaps and age <= RECUR_GAPS * sum(gaps) / len(gaps) + startup:
                return level
        return floor

    def _startup(self, s: dict, now: float, target: int, ready: int) -> float:
        """Start-up seconds: the configured value until an ask has been seen through to running."""
        ask = s.get("ask")
        if ask is not None:
            asked_at, count = ask
            if ready >= min(count, target):  # all asked for run (or the ask was cut back)
                if ready >= count:
                    s["startup_s"] = now - asked_at
                s["ask"] = None
        return s.get("startup_s") or self.cfg.startup_s


def queue_depth_policy(ctx) -> Tuple[int, Dict[str, Any]]:
    """The policy with its default knobs, as a plain function (Serve passes no kwargs to functions)."""
    return _DEFAULT(ctx)


_DEFAULT = QueueDepthPolicy()
