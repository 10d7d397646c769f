"""The fleet simulator's parts around the fleet (cluster/fleet_sim.py): the workload its replicas
serve, a policy as Serve's controller runs it, and what a run records."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import ray.serve.autoscaling_policy as serve_policy

# Private in Ray 2.60, no public equivalent: the wrapper (factors, delays, cold start) Serve's
# controller puts around every policy: the simulation runs Serve's code, not a copy.
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from batcher.simulated import PRESETS, StepTimeModel
from router.cost_model import capacity_rps, completion_rate

TTFT_BINS = np.concatenate([[0.0], np.logspace(-3, 4, 1401)])  # 1 ms .. 10^4 s, 0.5% wide


@dataclass
class SimWorkload:
    preset: str = "h100-llama3-8b"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prompt_tokens: int = 512
    output_tokens: Optional[int] = None  # mean; default: the preset's mean answer
    step_scale: float = 1.0  # replicas measured this much slower (or faster) than the preset

    @property
    def step(self) -> StepTimeModel:
        s = PRESETS[self.preset].step
        k = self.step_scale
        return (
            s
            if k == 1.0
            else StepTimeModel(s.fixed_s * k, s.prefill_token_s * k, s.decode_seq_s * k, s.context_token_s * k)
        )

    @property
    def mean_output(self) -> int:
        return self.output_tokens or PRESETS[self.preset].mean_answer_tokens

    def throughput_rps(self, concurrency: float) -> float:
        """Requests per second one replica completes at a steady `concurrency` running sequences."""
        return completion_rate(self.step, concurrency, self.prompt_tokens, self.mean_output)

    def capacity_rps(self, fill: float = 1.0) -> float:
        """Requests per second one replica keeps up with at `fill` of both its limits: max_num_seqs
        running, and max_num_batched_tokens of prefill per step (long prompts fill that one first)."""
        return capacity_rps(
            self.step, self.max_num_seqs, self.max_num_batched_tokens, self.prompt_tokens, self.mean_output, fill
        )


@dataclass
class Result:
    """Time series (one point per control tick) and the TTFT histogram (requests per bin)."""

    name: str
    t: List[float] = field(default_factory=list)
    replicas: List[int] = field(default_factory=list)  # billed: starting + ready + draining
    ready: List[int] = field(default_factory=list)
    target: List[int] = field(default_factory=list)
    queue: List[float] = field(default_factory=list)
    rate: List[float] = field(default_factory=list)
    ttft_hist: np.ndarray = field(default_factory=lambda: np.zeros(len(TTFT_BINS)))
    within_slo: float = 0.0
    replica_seconds: float = 0.0
    requests: float = 0.0
    unfinished: float = 0.0
    # Per second of arrival time: requests that arrived, and those whose first token missed the SLO.
    arrived: np.ndarray = field(default_factory=lambda: np.zeros(0))
    missed: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def ttft_quantile(self, q: float) -> float:
        """TTFT at quantile q (the upper edge of the bin it falls in)."""
        cum = np.cumsum(self.ttft_hist)
        i = int(np.searchsorted(cum, q * cum[-1]))
        return float(TTFT_BINS[min(i, len(TTFT_BINS) - 1)])

    @property
    def served(self) -> float:
        return float(self.ttft_hist.sum())


class _Clock:
    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


class Policy:
    """A policy as Serve's controller runs it: wrapped with Serve's config logic, then bounded."""

    def __init__(self, name: str, fn: Callable, config: AutoscalingConfig):
        self.name, self.config = name, config
        self.wrapped = _apply_autoscaling_config(fn)
        self.state: Dict = {}

    def decide(self, ctx: AutoscalingContext) -> int:
        # Serve's delay logic reads time.time(): give it the simulated clock for this call.
        real = serve_policy.time
        serve_policy.time = _Clock(ctx.current_time)
        try:
            n, self.state = self.wrapped(ctx)
        finally:
            serve_policy.time = real
        n = math.ceil(n)
        return max(self.config.min_replicas, min(self.config.max_replicas, n))


def serve_mean(times: np.ndarray, values: np.ndarray, now: float) -> float:
    """The handles' requests as Ray 2.60's controller averages them (autoscaling_metrics_merge): the
    sources' series merged into change points, each held until the next, the last until `now`. A
    leading run of zeros has no change point, so after a quiet look-back the mean starts at the
    first request (a burst after a lull is read at its own level, not diluted by the lull); all zeros
    read 0."""
    busy = np.flatnonzero(values)
    if not busy.size:
        return 0.0
    t, v = times[busy[0] :], values[busy[0] :]
    held = np.append(t[1:], max(now, t[-1])) - t
    return float(np.dot(v, held) / held.sum()) if held.sum() > 0 else float(v[-1])
