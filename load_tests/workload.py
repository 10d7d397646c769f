"""Seeded synthetic workloads: the seeds' "variance experiment" at CPU scale.

Prompts are random token ids drawn uniformly from the vocabulary's ordinary range (every id above the
highest special token), so no corpus is needed and no two prompts share a prefix. Output lengths come
from one exponential draw per request (mean `mean_output`), rounded up and capped per experiment, so
the same requests keep the same prompts and the same underlying draw across caps: only the cap
changes, which is what isolates the effect of output-length variance. EOS is ignored: every request
generates exactly `max_tokens` tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Sequence


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: List[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: List[WorkloadRequest]
    cap: int = 0  # the output-length cap it was drawn with (0: none)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def describe(self) -> dict:
        lengths = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "cap": self.cap,
            "num_requests": len(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_len_mean": self.output_tokens / max(1, len(lengths)),
            "output_len_max": max(lengths, default=0),
        }


def text_token_range(tokenizer) -> tuple[int, int]:
    """[low, high) of ids that are ordinary text tokens: above every special token, below the vocab size."""
    special = [i for i in tokenizer.all_special_ids if i is not None]
    # Added tokens flagged special (SmolLM2's <repo_name>, <jupyter_*>...) are not in all_special_ids.
    special += [i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special]
    return (max(special) + 1 if special else 0), len(tokenizer)


def random_prompts(num: int, length: int, token_range: tuple[int, int], seed: int) -> List[List[int]]:
    rng = random.Random(f"prompts-{seed}")  # string seeds are stable across Python versions
    low, high = token_range
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(num)]


def exponential_draws(num: int, mean: float, seed: int) -> List[float]:
    rng = random.Random(f"lengths-{seed}")
    return [rng.expovariate(1.0 / mean) for _ in range(num)]


def capped_lengths(draws: Sequence[float], cap: int) -> List[int]:
    return [min(cap, max(1, math.ceil(x))) for x in draws]


def variance_workloads(
    caps: Sequence[int],
    num_prompts: int = 128,
    prompt_len: int = 64,
    mean_output: float = 32.0,
    token_range: tuple[int, int] = (17, 49152),
    seed: int = 0,
) -> List[Workload]:
    """One workload per cap: same prompts, same exponential draws, lengths capped at each cap."""
    prompts = random_prompts(num_prompts, prompt_len, token_range, seed)
    draws = exponential_draws(num_prompts, mean_output, seed)
    return [
        Workload(f"cap{cap}", [WorkloadRequest(p, n) for p, n in zip(prompts, capped_lengths(draws, cap))], cap)
        for cap in caps
    ]


def representative_subset(workload: Workload, size: int) -> List[int]:
    """Indices of `size` requests at evenly spaced quantiles of output length.

    A slow baseline (naive one-at-a-time generate) is timed on a subset; taking quantiles instead of a
    random sample keeps the subset's length mix, hence its tokens/s, close to the full workload's.
    """
    n = len(workload.requests)
    if size >= n:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (workload.requests[i].max_tokens, i))
    return sorted(order[int((k + 0.5) * n / size)] for k in range(size))
