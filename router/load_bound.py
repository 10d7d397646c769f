"""The load bound (LLMRouterConfig.load_bound; router.scoring.score_replicas applies it): how much a
replica may hold, and its window (`load_window_s`): what the fleet held, and where this router sent its
requests, over the last seconds. The bound judges a replica by these rather than by one instant's
counts: at a handful of sequences an instant's count is mostly chance (a user reading between turns,
the last users of a wave), and acting on chance moves conversations off their caches."""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Deque, Hashable, Optional, Sequence, Tuple, Union

import numpy as np

from batcher.simulated import StepTimeModel
from router.cost_model import FleetStepTimes


def bounded_load(total: float, replicas: int, load_bound: float) -> int:
    """The most a replica may hold of `total` + 1 (sequences, or requests sent): `load_bound` x
    the mean, and at least the mean rounded up plus one (at small counts the ratio alone would
    bite on chance)."""
    mean = (total + 1) / max(1, replicas)
    return max(math.ceil(load_bound * mean), math.ceil(mean) + 1)


FREE_BATCH_SLOWDOWN = 0.10


def free_batch(step: Union[StepTimeModel, FleetStepTimes], context_tokens: int):
    """The most sequences of `context_tokens` a replica steps within FREE_BATCH_SLOWDOWN of one
    sequence's step time (an array from FleetStepTimes): below it a sequence costs the others in the
    batch next to nothing. Where weights dominate a step (an H100 decoding 8B: 6 ms fixed, 0.1 ms per
    sequence of 2,000 tokens) that is 6 sequences; where sequences do (a CPU), 1."""
    per_sequence = step.decode_seq_s + context_tokens * step.context_token_s
    lone = step.step_seconds(0, 1, context_tokens)
    return 1 + np.floor(FREE_BATCH_SLOWDOWN * lone / np.maximum(per_sequence, 1e-12))


class LoadWindow:
    """One router's window: the fleet's recent peak of sequences and its own recent requests per replica."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._peaks: Deque[Tuple[float, float]] = deque()  # (time, fleet sequences), decreasing
        self._routes: Deque[Tuple[float, Hashable]] = deque()  # (time, replica) of each new request
        self._counts: Counter = Counter()

    def peak(self, now: float, sequences: float) -> float:
        """The most sequences the fleet held within the window (`sequences` now included): a deque
        of decreasing counts, so each decision costs O(1) amortized."""
        peaks = self._peaks
        while peaks and peaks[-1][1] <= sequences:
            peaks.pop()
        peaks.append((now, sequences))
        while peaks[0][0] < now - self.window_s:
            peaks.popleft()
        return peaks[0][1]

    def routed(self, now: float, replica: Hashable) -> None:
        """This router sent a new request to `replica` (once per request, on its first choice)."""
        self._routes.append((now, replica))
        self._counts[replica] += 1

    def recent_routes(self, now: float, replicas: Sequence[Hashable]) -> Optional[np.ndarray]:
        """Requests this router sent each of `replicas` within the window; None without a window
        (then no share can be judged)."""
        if self.window_s <= 0:
            return None
        routes = self._routes
        while routes and routes[0][0] < now - self.window_s:
            _, replica = routes.popleft()
            self._counts[replica] -= 1
            if not self._counts[replica]:
                del self._counts[replica]
        return np.fromiter((self._counts.get(r, 0) for r in replicas), float, len(replicas))
