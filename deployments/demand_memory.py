"""The autoscaling policy's memory of demand (deployments/autoscaling.py): the arrival rate's
average, demand per bucket over the last MEMORY_STARTUPS start-ups, a ramp in it, the spells with
requests queued, and the system's growth. Functions of the policy's state dict `s` (it lives in
Serve's policy_state between control ticks)."""

from __future__ import annotations

import math
from statistics import median
from typing import Tuple

MEMORY_STARTUPS = 30  # how far back demand is remembered, in start-ups (30 min at 60 s)
BUCKETS_PER_STARTUP = 6  # resolution of the memory: a 60 s start-up -> 10 s buckets (the traces' bins)
RAMP_T = 3.0  # a slope this many standard errors above zero is a ramp (~99% one-sided over 7 buckets)
GROWTH_SPAN_S = 5.0  # arrivals are completions + growth over this span (Serve's look-back for this policy)


def smoothed(s: dict, now: float, value: float, tau: float, key: str) -> float:
    """An exponential average over ~tau seconds, kept in s[key] (rates from 5 s of counts are noisy)."""
    last = s.get(key)
    if last is None:
        s[key] = (now, value)
        return value
    a = 1.0 - math.exp(-max(0.0, now - last[0]) / tau)
    s[key] = (now, last[1] + a * (value - last[1]))
    return s[key][1]


def remember(s: dict, now: float, startup: float, arrivals: float, demand: float) -> None:
    """Arrivals and requests in the system per bucket (means over its ticks), over the last
    MEMORY_STARTUPS start-ups: [bucket start, arrivals, demand, ticks]. Kept as load, not as
    replicas, so a better measured mu resizes what is remembered."""
    width = startup / BUCKETS_PER_STARTUP
    start = math.floor(now / width) * width
    mem = [b for b in s.get("memory", []) if now - b[0] <= MEMORY_STARTUPS * startup]
    if mem and mem[-1][0] == start:
        t, a, d, k = mem[-1]
        mem[-1] = [t, (a * k + arrivals) / (k + 1), (d * k + demand) / (k + 1), k + 1]
    else:
        mem.append([start, arrivals, demand, 1])
    s["memory"] = mem


def queue_spells(s: dict, now: float, startup: float, queued: float) -> None:
    """Spells with requests queued: when the current one began, and how long the ended ones
    of the memory lasted."""
    since = s.get("queue_since")
    if queued > 0 and since is None:
        s["queue_since"] = now
    elif queued <= 0 and since is not None:
        ended = [e for e in s.get("queue_spells", []) if now - e[0] <= MEMORY_STARTUPS * startup]
        s["queue_spells"], s["queue_since"] = ended + [(now, now - since)], None


def queues_outlast(s: dict, now: float, startup: float) -> bool:
    """Whether a queue now likely outlasts a start-up: queues have (the median spell of the
    memory), none has ended yet to say otherwise, or this one has lasted a start-up or longer than
    every spell of the memory (a standing queue after short ones is not one of them)."""
    since = s.get("queue_since")
    spells = [d for t, d in s.get("queue_spells", []) if now - t <= MEMORY_STARTUPS * startup]
    outlasted = since is not None and now - since >= min(startup, max(spells, default=startup))
    return not spells or median(spells) >= startup or outlasted


def trend(s: dict, startup: float) -> float:
    """A ramp: arrivals over the last start-up's buckets that rose in at least 5 of its 6 steps, or
    whose least-squares slope is RAMP_T standard errors above zero (a slow ramp at a high rate rises
    about one noise's width a bucket, which the steps' signs miss), by at most their own level,
    rise as much over the next start-up, when the replicas asked now land. A burst jumps and then
    wanders: no trend (the backlog rule has it)."""
    rates = [a for _, a, _, _ in s.get("memory", [])[-(BUCKETS_PER_STARTUP + 2) : -1]]  # complete buckets
    if len(rates) < BUCKETS_PER_STARTUP + 1:
        return 0.0
    steps = [b - a for a, b in zip(rates, rates[1:])]
    rises = [rates[-1] - rates[0]] if sum(d > 0 for d in steps) >= BUCKETS_PER_STARTUP - 1 else []
    n = len(rates)
    mid, mean = (n - 1) / 2, sum(rates) / n
    sxx = sum((i - mid) ** 2 for i in range(n))
    slope = sum((i - mid) * (r - mean) for i, r in enumerate(rates)) / sxx
    residuals = sum((r - mean - slope * (i - mid)) ** 2 for i, r in enumerate(rates))
    if slope > 0 and slope * math.sqrt(sxx * (n - 2)) >= RAMP_T * math.sqrt(residuals):
        rises.append(slope * BUCKETS_PER_STARTUP)
    # More than doubling within a start-up is a jump, not a ramp.
    return max((r for r in rises if 0 < r <= rates[0]), default=0.0)


def growth(s: dict, now: float, demand: float, queued: float) -> Tuple[float, float]:
    """Requests per second the system and the queue gained over the last ~GROWTH_SPAN_S."""
    history = [h for h in s.get("history", []) if now - h[0] <= 2 * GROWTH_SPAN_S]
    history.append((now, demand, queued))
    s["history"] = history
    old = [h for h in history if now - h[0] >= GROWTH_SPAN_S]
    t0, d0, q0 = old[-1] if old else history[0]
    return ((demand - d0) / (now - t0), (queued - q0) / (now - t0)) if now > t0 else (0.0, 0.0)
