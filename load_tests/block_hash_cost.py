"""What the prefix cache's SHA-256 block hash costs, beside the tuple hash it replaced.

    python -m load_tests.block_hash_cost [--json results/block_hash_cost.json]

Times, on this machine: one block, a whole prompt (what the router and match_prefix hash per
request), and the engine's per-step hashing in a decode batch (BlockManager.cache_full_blocks over
every running sequence, a block filling every block_size steps). The tuple hash is timed here only
as the baseline it was.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

from batcher.block_hash import cacheable_block_hashes, root_hash
from batcher.block_manager import BlockManager
from batcher.sampling_params import SamplingParams
from batcher.sequence import Sequence


def tuple_chain(tokens, block_size: int) -> list:
    out, parent = [], -1
    for i in range((len(tokens) - 1) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


def best_of(fn: Callable[[], None], repeat: int = 7, number: int = 20) -> float:
    """Seconds per call: the best of `repeat` runs (the machine is shared: the minimum is the cost)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def decode_step_seconds(num_seqs: int, block_size: int, context: int) -> float:
    """cache_full_blocks over `num_seqs` decoding sequences, per step, averaged over block_size steps."""
    bm = BlockManager(num_seqs * (context // block_size + 4), block_size)
    root = root_hash("bench")
    seqs = [Sequence(str(i), [i] * context, SamplingParams(), cache_root=root) for i in range(num_seqs)]
    for s in seqs:
        bm.admit(s, [])
        bm.grow(s, context)
        s.num_computed_tokens = context
        bm.cache_full_blocks(s)
    total = 0.0  # cache_full_blocks alone: the decode bookkeeping around it is not timed
    for step in range(block_size):
        for s in seqs:
            s.append_token(step)
            bm.grow(s, 1)
            s.num_computed_tokens += 1
        t0 = time.perf_counter()
        for s in seqs:
            bm.cache_full_blocks(s)
        total += time.perf_counter() - t0
    return total / block_size


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default="results/block_hash_cost.json", help="where the figures go as JSON")
    args = ap.parse_args(argv)
    bs, tokens, root = args.block_size, list(range(1000, 1000 + args.prompt_tokens)), root_hash("bench")
    block = tokens[: bs + 1]
    rows = {
        "one block, us": (
            best_of(lambda: tuple_chain(block, bs), number=2000) * 1e6,
            best_of(lambda: cacheable_block_hashes(block, bs, root), number=2000) * 1e6,
        ),
        f"{args.prompt_tokens}-token prompt, us": (
            best_of(lambda: tuple_chain(tokens, bs)) * 1e6,
            best_of(lambda: cacheable_block_hashes(tokens, bs, root)) * 1e6,
        ),
    }
    step = min(decode_step_seconds(args.batch, bs, 512) for _ in range(5)) * 1e6
    print(f"{'':34} {'tuple hash':>11} {'SHA-256':>9}")
    for name, (old, new) in rows.items():
        print(f"{name:34} {old:11.1f} {new:9.1f}")
    print(
        f"{'decode step, ' + str(args.batch) + ' sequences, us':34} {'':>11} {step:9.1f}"
        "  (cache_full_blocks over the batch, SHA-256)"
    )
    out = {
        "block_size": bs,
        "prompt_tokens": args.prompt_tokens,
        "batch": args.batch,
        "tuple_us": {k: v[0] for k, v in rows.items()},
        "sha256_us": {k: v[1] for k, v in rows.items()},
        "decode_step_hash_us": step,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
