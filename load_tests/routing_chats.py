"""The routing benchmark's chat workloads: users in multi-turn chats over a few long system prompts
(`shared`; `skew` with half of them on one; `unique`: one-turn chats of their own), and when each
user's first turn goes out. Each turn is sent after the last answer, at once (a closed loop) or
after the user's think time (load_tests.bench_client.think_times)."""

from __future__ import annotations

import random
from typing import List, Optional

from load_tests.bench_client import BenchRequest

_WORDS = (
    "data model serve token cache route replica batch queue stream system user answer engine "
    "prompt prefix block memory latency request cluster policy scale shard node tensor"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


def sessions(
    kind: str, users: int, turns: int, system_words: int, user_words: int, max_tokens: int, seed: int
) -> List[BenchRequest]:
    """One multi-turn chat per user: a system prompt, then its user turns, each sent after the last answer.
    The workloads run one after another on the same fleet: they share the four system prompts (warm,
    as on a fleet in service) but each has its own users' turns, so no workload replays another's
    conversations from the cache."""
    systems_rng = random.Random(seed)
    systems = [f"System prompt {i}. " + text(systems_rng, system_words) for i in range(4)]
    rng = random.Random(f"{seed}:{kind}")
    out = []
    for u in range(users):
        if kind == "unique":
            system, n = f"Private prompt {u}. " + text(rng, system_words), 1
        else:
            hot = kind == "skew" and u % 2 == 0
            system, n = systems[0 if hot else u % len(systems)], turns
        said = [f"User {u} turn {t}: " + text(rng, user_words) for t in range(n)]
        out.append(
            BenchRequest(
                messages=[{"role": "system", "content": system}, {"role": "user", "content": said[0]}],
                followups=tuple(said[1:]),
                max_tokens=max_tokens,
                ignore_eos=True,
            )
        )
    return out


def chat_starts(users: int, think_s: float, seed: int) -> Optional[List[float]]:
    """When each user's first turn is sent: all at once in a closed loop (`think_s` 0: None); users who
    think arrive spread uniformly over one mean think time, seeded, as they would come and go, not as
    one crowd at the start."""
    if think_s <= 0:
        return None
    rng = random.Random(f"starts:{seed}")
    return sorted(rng.uniform(0.0, think_s) for _ in range(users))
