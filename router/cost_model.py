"""Step times learned from what the replicas measure, a preset only as the prior.

    step seconds = fixed + prefill tokens x a + decoding sequences x b + context tokens x c

Replica side, `StepMeter` (LLMServer.record_routing_stats feeds it the engine's cumulative counters
at every report): each report interval becomes one sample, the per-step means of that interval's
steps (1, prefill tokens, decoding sequences, context tokens) against its seconds per step, weighted
by its number of steps. The model is linear, so means of steps obey it as single steps do. The
replica reports the normal equations of the last `window` samples (`step_fit`: steps, xtx, xty), not
a fitted model: the router shrinks it toward a prior of its own, and sums from several reports could
be pooled.

The replica also keeps its requests' mean size over the window (prompt tokens it computed, tokens
it generated per request ended), so `StepMeter.capacity` can say what it would complete running all
its slots without ever running them (`capacity_rps`): the autoscaler's mu until a replica has been
full (deployments/autoscaling.py).

Router side, `learned_step`: least squares over those sums, each term's factor over the preset
shrunk toward it in log terms: with few steps measured the preset holds, after a few hundred the
replica's own measurements do. So on fast-prefill hardware the
router learns that a cache hit saves little against a queue, and on slow-prefill hardware the
reverse, whatever the preset said. A stale report's fit is unknown, as its load is: the prior.

`FleetStepTimes` holds one model per candidate replica as columns, for scoring.py's numpy decision.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Sequence, Tuple

import numpy as np

from batcher.simulated import StepTimeModel

PRIOR_STEPS = 20.0  # the preset weighs as much as this many measured steps
SAMPLES = 120  # report intervals in the replica's window (1-2 minutes at Serve's polling)
BUSY_SAMPLES = 20  # report intervals over which the busy share is measured (load changes faster)
_W_RANGE = (0.01, 100.0)  # a term may differ this much from its prior (beyond: collinear data, not hardware)


def coefficients(step: StepTimeModel) -> Tuple[float, float, float, float]:
    return (step.fixed_s, step.prefill_token_s, step.decode_seq_s, step.context_token_s)


@dataclass(frozen=True)
class _Counters:
    steps: int
    seconds: float
    tokens: int  # computed: prefill chunks + one per decoding sequence
    generated: int  # sampled: one per decoding sequence + one per prompt finished
    admitted: int  # requests added so far (each finishes one prefill)
    ended: int  # requests finished, aborted or failed so far
    ended_output: int  # tokens those requests generated
    context: int  # tokens held by running sequences now

    @classmethod
    def of(cls, stats) -> "_Counters":
        ended = stats.finished_requests + stats.aborted_requests + stats.failed_requests
        return cls(
            stats.steps,
            stats.step_seconds,
            stats.tokens_computed,
            stats.generated_tokens,
            ended + stats.waiting + stats.running,
            ended,
            stats.ended_output_tokens,
            stats.context_tokens,
        )


class StepMeter:
    """What one replica measured of its steps, from its engine's counters (EngineStats) read at
    each report. Plain Python, no Serve: LLMServer calls `observe(stats)` and reports `fit()`."""

    def __init__(self, window: int = SAMPLES):
        self._last: Optional[_Counters] = None
        self._last_time = 0.0
        self._samples: Deque[Tuple[float, np.ndarray, float]] = deque(maxlen=window)  # (steps, x, seconds/step)
        self._busy: Deque[Tuple[float, float]] = deque(maxlen=BUSY_SAMPLES)  # (wall seconds, step seconds)
        # (prefill tokens, requests admitted, tokens the ended requests generated, requests ended) per interval
        self._sizes: Deque[Tuple[int, int, int, int]] = deque(maxlen=window)

    def observe(self, stats, now_s: Optional[float] = None) -> None:
        """The engine's counters (EngineStats) at `now_s` (time.monotonic() by default)."""
        now_s = time.monotonic() if now_s is None else now_s
        now = _Counters.of(stats)
        last, self._last = self._last, now
        last_time, self._last_time = self._last_time, now_s
        if last is None:
            return
        if now_s > last_time:
            self._busy.append((now_s - last_time, now.seconds - last.seconds))
        # Sampled tokens less one per prompt finished are decode steps (a prompt finishing in the
        # next interval is counted here: the error is one token per request, both ways).
        computed = now.tokens - last.tokens
        decode = min(max(0, (now.generated - last.generated) - (now.admitted - last.admitted)), computed)
        prefill = computed - decode
        if now.admitted > last.admitted or now.ended > last.ended or computed > 0:
            # Answers are counted whole as they end: tokens sampled in the window and requests ended
            # in it would read short for a window after a load change (its first ends began before it).
            self._sizes.append(
                (prefill, now.admitted - last.admitted, now.ended_output - last.ended_output, now.ended - last.ended)
            )
        if now.steps <= last.steps:
            return
        n = now.steps - last.steps
        x = np.array([1.0, prefill / n, decode / n, (now.context + last.context) / 2.0])
        self._samples.append((float(n), x, (now.seconds - last.seconds) / n))

    def fit(self) -> dict:
        """The normal equations of the window (weights: steps per sample), and `busy`, the share of
        the last few intervals the engine spent stepping; {} before any step."""
        if not self._samples:
            return {}
        n = np.array([s[0] for s in self._samples])
        x = np.array([s[1] for s in self._samples])
        y = np.array([s[2] for s in self._samples])
        wall = sum(w for w, _ in self._busy)
        busy = min(1.0, sum(b for _, b in self._busy) / wall) if wall > 0 else 0.0
        return {"steps": float(n.sum()), "xtx": ((x.T * n) @ x).tolist(), "xty": ((x.T * n) @ y).tolist(), "busy": busy}

    def request_size(self) -> Optional[Tuple[float, float]]:
        """(prompt tokens computed per request admitted, tokens generated per request ended) over the
        window; None before a request was admitted and one ended in it."""
        prefill, admitted, generated, ended = (sum(c) for c in zip(*self._sizes)) if self._sizes else (0, 0, 0, 0)
        return (prefill / admitted, generated / ended) if admitted > 0 and ended > 0 and generated > 0 else None

    def capacity(
        self, prior: StepTimeModel, max_num_seqs: int, max_num_batched_tokens: int, kv_tokens: Optional[float] = None
    ) -> float:
        """Requests per second this replica would complete running all it can (`capacity_rps`), from
        its step times (learned_step over `prior`) and its requests' mean size; 0.0 before it knows
        their size."""
        size = self.request_size()
        if size is None:
            return 0.0
        prompt, output = size
        # Running sequences hold their prompt and about half their output in KV blocks.
        slots = max_num_seqs if not kv_tokens else min(max_num_seqs, kv_tokens / max(prompt + output / 2, 1.0))
        return capacity_rps(learned_step(prior, self.fit()), slots, max_num_batched_tokens, prompt, output)


def completion_rate(step: StepTimeModel, running: float, prompt_tokens: float, output_tokens: float) -> float:
    """Requests per second an engine completes at a steady `running` sequences: every step decodes
    one token of each and prefills the prompts of those that replace the ones ending in it."""
    prefill = running / output_tokens * prompt_tokens
    seconds = step.step_seconds(prefill, running, running * (prompt_tokens + output_tokens))
    return running / (seconds * output_tokens)


def capacity_rps(
    step: StepTimeModel,
    max_running: float,
    max_num_batched_tokens: float,
    prompt_tokens: float,
    output_tokens: float,
    fill: float = 1.0,
) -> float:
    """Requests per second a full engine completes: at `fill` of its running limit, or of the running
    count whose replacements' prompts fill the step's token budget, whichever is lower (long prompts)."""
    output_tokens = max(output_tokens, 1.0)
    by_prefill = max_num_batched_tokens * output_tokens / max(prompt_tokens, 1.0)
    return completion_rate(step, fill * min(max_running, by_prefill), prompt_tokens, output_tokens)


def learned_step(prior: StepTimeModel, fit: Optional[dict], prior_steps: float = PRIOR_STEPS) -> StepTimeModel:
    """The replica's step-time model: its measurements (`fit`, as StepMeter.fit reported it) shrunk
    toward `prior`; the prior itself without measurements.

    Hardware differs from a preset by factors, not offsets, so each term's measured factor w (over
    the prior's) is shrunk in log terms, w ** (steps / (steps + prior_steps)): the preset holds for the
    first few steps, the measurements after a few hundred. The factors come from least squares with
    every term in the prior's seconds (so the four weigh alike), anchored at the prior's shape scaled
    to the measured level by a ridge of `prior_steps` steps' weight: a term the steps did not
    exercise (no prefill yet, a batch that never varied) follows the level instead of drifting."""
    theta0 = np.array(coefficients(prior))
    steps = float((fit or {}).get("steps", 0.0))
    if steps <= 0:
        return prior
    a = np.asarray(fit["xtx"], dtype=float) * np.outer(theta0, theta0)
    b = np.asarray(fit["xty"], dtype=float) * theta0
    level = b.sum() / a.sum() if a.sum() > 0 else 0.0
    if not level > 0:
        return prior
    scale = np.diag(a) / steps
    ridge = prior_steps * np.maximum(scale, 1e-9 * scale.max(initial=0.0) + 1e-300)
    try:
        w = np.linalg.solve(a + np.diag(ridge), b + ridge * level)
    except np.linalg.LinAlgError:
        return prior
    w = np.clip(np.nan_to_num(w, nan=level), *_W_RANGE)
    w = np.exp(np.log(w) * steps / (steps + prior_steps))
    return StepTimeModel(*(float(v) for v in theta0 * w))


@dataclass(frozen=True)
class FleetStepTimes:
    """One step-time model per candidate replica, as columns: `step_seconds` takes arrays as well."""

    fixed_s: np.ndarray
    prefill_token_s: np.ndarray
    decode_seq_s: np.ndarray
    context_token_s: np.ndarray

    @classmethod
    def of(cls, models: Sequence[Tuple[float, float, float, float]]) -> "FleetStepTimes":
        cols = np.array(models, dtype=float).reshape(-1, 4).T
        return cls(*cols)

    @classmethod
    def uniform(cls, step: StepTimeModel, n: int) -> "FleetStepTimes":
        return cls.of([coefficients(step)] * n)

    def step_seconds(self, prefill_tokens, decode_seqs, context_tokens) -> np.ndarray:
        return (
            self.fixed_s
            + prefill_tokens * self.prefill_token_s
            + decode_seqs * self.decode_seq_s
            + context_tokens * self.context_token_s
        )
