"""BlockManager exercised as the scheduler would, without a model: shared by
tests/test_block_manager.py and tests/test_eviction_feed.py."""

import random

from batcher.block_hash import root_hash
from batcher.block_manager import BlockManager
from batcher.sampling_params import SamplingParams
from batcher.sequence import Sequence


def seq(tokens, rid="r", salt=None) -> Sequence:
    """A sequence of `tokens` whose blocks hash under the test model's root (and `salt`)."""
    return Sequence(rid, list(tokens), SamplingParams(), cache_root=root_hash("test-model", salt))


def random_operations(seed: int, steps: int = 400, eviction_stride: int = 1):
    """Admit (with prefix hits), prefill in chunks, decode, preempt and finish in random order over
    prompts that share prefixes, as the scheduler would; yields (manager, live sequences) after each
    operation and frees everything at the end."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([12, 24, 48]), block_size=rng.choice([2, 4]))
    bm.evictions.stride = eviction_stride
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    live, waiting = [], []
    for i in range(steps):
        op = rng.random()
        if op < 0.2:  # a new request sharing a prefix, maybe under a salt
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            waiting.append(seq(tokens, f"r{i}", salt=rng.choice([None, None, "t"])))
        elif op < 0.4 and waiting:  # admission, as the scheduler does it
            s = waiting[0]
            cached = bm.match_prefix(s)
            if bm.can_admit(cached, s.num_tokens - len(cached) * bm.block_size, reserve=1):
                bm.admit(s, cached)
                live.append(waiting.pop(0))
        elif op < 0.75 and live:  # a step: a prefill chunk, or a decode token
            s = rng.choice(live)
            left = s.num_tokens - s.num_computed_tokens
            n = rng.randint(1, left) if left > 0 else 0
            if n == 0:
                s.append_token(rng.randrange(50))
                n = 1
            if bm.grow(s, n):
                s.num_computed_tokens += n
                bm.cache_full_blocks(s)
            else:  # out of blocks: preempt it (recompute), as the scheduler would
                bm.free(s)
                live.remove(s)
                waiting.insert(0, s)
        elif live:  # finished or aborted
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        yield bm, live
    for s in live:
        bm.free(s)
    live.clear()
    yield bm, live
