"""Request-rate traces: `t_s,rate_rps` CSV files and the built-in day-shaped trace with bursts."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

import numpy as np


@dataclass
class Trace:
    """Arrival rate over time, linear between points; `steady` lists (start, end) spans of steady
    load (where oscillation is counted)."""

    t_s: np.ndarray
    rate_rps: np.ndarray
    name: str = "trace"
    steady: List[Tuple[float, float]] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return float(self.t_s[-1])

    def rate(self, t) -> np.ndarray:
        return np.interp(t, self.t_s, self.rate_rps)

    def max_over(self, t0: float, t1: float) -> float:
        """Highest rate in [t0, t1] (the points inside and both ends)."""
        inside = self.rate_rps[(self.t_s > t0) & (self.t_s < t1)]
        return float(max(self.rate(t0), self.rate(t1), inside.max() if inside.size else 0.0))

    def lookahead_correlation(self, lag_s: float, bin_s: float = 10.0) -> float:
        """Correlation of the rate (bin_s bins) with itself lag_s later: how much what a policy sees
        now tells it of the load when replicas it asks for land. Near 0, no online policy can place
        capacity at the bursts (the best constant fleet at equal replica-seconds bounds it)."""
        rate = self.rate(np.arange(0.0, self.duration_s, bin_s))
        k = max(1, round(lag_s / bin_s))
        if len(rate) <= k + 1 or rate[:-k].std() == 0 or rate[k:].std() == 0:
            return float("nan")
        return float(np.corrcoef(rate[:-k], rate[k:])[0, 1])

    def scaled(self, factor: float) -> "Trace":
        return Trace(self.t_s, self.rate_rps * factor, self.name, list(self.steady))


def load_csv(path: str) -> Trace:
    """A CSV with a header `t_s,rate_rps`; times ascending from 0."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"t_s", "rate_rps"} <= set(rows[0]):
        raise ValueError(f"{path}: expected columns t_s,rate_rps")
    t = np.array([float(r["t_s"]) for r in rows])
    rate = np.array([float(r["rate_rps"]) for r in rows])
    if (np.diff(t) <= 0).any() or (rate < 0).any():
        raise ValueError(f"{path}: t_s must increase and rate_rps be >= 0")
    trace = Trace(t - t[0], rate, Path(path).stem)
    trace.steady = steady_spans(trace)
    return trace


def steady_spans(trace: Trace, window_s: float = 600.0, tolerance: float = 0.1) -> List[Tuple[float, float]]:
    """Spans of at least window_s where the rate stays within +-tolerance of the span's mean."""
    grid = np.arange(0.0, trace.duration_s, 10.0)
    rate = trace.rate(grid)
    spans, start = [], 0
    for i in range(1, len(grid) + 1):
        seg = rate[start:i]
        mean = seg.mean() if seg.size else 0.0
        if i == len(grid) or (mean > 0 and np.abs(rate[start : i + 1] - mean).max() > tolerance * mean):
            if grid[min(i, len(grid) - 1)] - grid[start] >= window_s:
                spans.append((float(grid[start]), float(grid[min(i, len(grid) - 1)])))
            start = i
    return spans


def day_trace(peak_rps: float = 3000.0, hours: float = 4.0) -> Trace:
    """A day compressed into `hours`: night trough (8% of peak), morning ramp, midday peak, afternoon
    dip, evening peak, and three bursts (a 2.5x flash crowd for 3 min, a 2x spike for 1 min, a step
    up that holds 20 min). Steady spans: the night, midday and evening plateaus."""
    day = 24 * 3600.0
    k = hours * 3600.0 / day  # trace seconds per day second
    shape = [  # (hour of day, share of peak)
        (0, 0.10),
        (3, 0.08),
        (5, 0.08),
        (7, 0.35),
        (9, 0.80),
        (10, 0.90),
        (13, 0.90),
        (14, 0.70),
        (16, 0.70),
        (18, 0.95),
        (20, 1.00),
        (22, 0.40),
        (24, 0.10),
    ]
    t = [h * 3600 * k for h, _ in shape]
    r = [s * peak_rps for _, s in shape]
    trace = Trace(np.array(t), np.array(r), "day")

    def bump(t0: float, rise: float, hold: float, factor: float):
        base = trace.rate([t0, t0 + rise + hold + rise])
        pts = [
            (t0, base[0]),
            (t0 + rise, base[0] * factor),
            (t0 + rise + hold, base[1] * factor),
            (t0 + 2 * rise + hold, base[1]),
        ]
        keep = (trace.t_s < t0) | (trace.t_s > t0 + 2 * rise + hold)
        tt = np.concatenate([trace.t_s[keep], [p[0] for p in pts]])
        rr = np.concatenate([trace.rate_rps[keep], [p[1] for p in pts]])
        order = np.argsort(tt)
        trace.t_s, trace.rate_rps = tt[order], rr[order]

    b = min(1.0, hours / 4.0)  # burst lengths as in the 4-hour day, shorter in shorter ones
    bump(7.5 * 3600 * k, 10.0 * b, 180.0 * b, 2.5)  # flash crowd on the morning ramp
    bump(15.0 * 3600 * k, 5.0 * b, 60.0 * b, 2.0)  # short spike in the afternoon
    bump(16.5 * 3600 * k, 30.0 * b, 1200.0 * b, 1.4)  # a step up that holds
    trace.steady = [(3 * 3600 * k, 5 * 3600 * k), (10 * 3600 * k, 13 * 3600 * k)]
    return trace


def write_csv(trace: Trace, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "rate_rps"])
        for t, r in zip(trace.t_s, trace.rate_rps):
            w.writerow([f"{t:.3f}", f"{r:.3f}"])
