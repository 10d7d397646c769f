"""When requests are sent: arrival processes of a load test, as offsets in seconds from the start.

Poisson arrivals have exponential gaps (mean 1/rate). Gamma arrivals keep the mean rate and change the
burstiness, as `vllm bench serve --burstiness` does: gaps ~ Gamma(shape=b, scale=1/(rate*b)); b = 1 is
Poisson, b < 1 burstier (coefficient of variation 1/sqrt(b) > 1), b > 1 more regular. An infinite
rate sends everything at t=0.
"""

from __future__ import annotations

import math
import random
from typing import List, Sequence


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> List[float]:
    """Send times of `num` requests at `rate` per second (inf: all at 0), first at 0."""
    if num < 0 or rate <= 0 or burstiness <= 0:
        raise ValueError(f"need num >= 0, rate > 0, burstiness > 0 (got {num}, {rate}, {burstiness})")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(f"arrivals-{seed}")  # string seeds are stable across Python versions
    scale = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def parse_rates(text: str) -> List[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf] (a sweep; one value is a single run)."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"request rates must be positive numbers or inf, got {text!r}")
    return rates


def gaps(offsets: Sequence[float]) -> List[float]:
    return [b - a for a, b in zip(offsets, offsets[1:])]
