"""Queueing arithmetic the autoscaling policy sizes with (deployments/autoscaling.py): the M/M/c tail
of a fleet of slot-servers, and the fluid queue of a burst."""

from __future__ import annotations

import functools
import math
from typing import List, Optional

MISS = 0.01  # the share of requests the sizing lets wait past the SLO (M/M/c, Poisson arrivals)
ERLANG_SERVERS = 512  # slots up to which P(wait) is computed (Erlang C); beyond, bounded by 1


def rate_per_s(series) -> Optional[float]:
    """Per-second increase of a cumulative counter over its raw window (None when under 1 s)."""
    if not series or len(series) < 2:
        return None
    first, last = series[0], series[-1]
    span = last.timestamp - first.timestamp
    return max(0.0, last.value - first.value) / span if span >= 1.0 else None


def ceil(x: float) -> int:
    """Ceiling that forgives float noise (3.0000000001 replicas is 3)."""
    return math.ceil(x - 1e-9)


@functools.lru_cache(maxsize=4096)
def replicas_within_slo(arrivals: float, mu: float, slots: float, slo_s: float) -> int:
    """The fewest replicas for which a request waits longer than the SLO with probability under
    MISS (M/M/c: P(wait) x exp(-(n mu - arrivals) slo)). With the slots known and few of them, each
    slot is a server of rate mu / slots and P(wait) is Erlang C; beyond ERLANG_SERVERS slots,
    P(wait) <= 1 (a spare of ln(1 / MISS) / slo requests per second: conservative)."""
    n = max(1, ceil(arrivals / mu))
    while True:
        c = n * slots
        if not slots or c > ERLANG_SERVERS:
            return max(n, ceil((arrivals + math.log(1 / MISS) / slo_s) / mu))
        a, b = arrivals * slots / mu, 1.0  # offered load in slot-servers; Erlang B by recursion
        for k in range(1, int(c) + 1):
            b = a * b / (k + a * b)
        wait = b / (1 - (a / c) * (1 - b)) if a < c else 1.0
        if a < c and wait * math.exp(-(n * mu - arrivals) * slo_s) <= MISS:
            return n
        n += 1


def burst_capacity(rates: List[float], width_s: float, slo_s: float, spell_buckets: int) -> List[float]:
    """Per bucket (arrivals per second, `width_s` each), the least service rate that kept the queue
    of the buckets up to it within the SLO: a queue waits past it once it holds more than slo x
    capacity, so over a spell of k buckets capacity >= arrivals x k width / (k width + slo), the
    highest over spells of up to `spell_buckets` ending at the bucket. A 10 s burst needs 10/11 of its
    rate (served from the queue within the SLO after it), a rate held for a minute 60/61."""
    out = []
    for i in range(len(rates)):
        best, total = 0.0, 0.0
        for k in range(1, min(spell_buckets, i + 1) + 1):
            total += rates[i - k + 1] * width_s
            best = max(best, total / (k * width_s + slo_s))
        out.append(best)
    return out
