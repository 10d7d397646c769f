"""The routing benchmark's trace workload: a public production trace with prefix block ids (Mooncake's
conversation trace by default), replayed at its own arrival times over the completions API, with
prompts built in the engine's tokens so requests sharing block ids share those prefixes exactly.

Also the share of prompt tokens an infinite prefix cache would serve on the same requests, in the
same order (each request's longest prefix, in the engine's blocks, that any earlier request
had): what no router can beat, the yardstick of the cached share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Set

from batcher.block_hash import cacheable_block_hashes, root_hash
from cluster.request_traces import bundled, load_request_trace, prompt_token_ids
from load_tests.bench_client import BenchRequest

TOKEN_RANGE = (17, 49152)  # ordinary token ids of the embedded tokenizer (SmolLM2's), no specials


@dataclass
class TraceWorkload:
    requests: List[BenchRequest]
    arrivals: List[float]  # seconds from the start, one per request
    infinite_cache_share: float
    description: dict


def leading_blocks(hashes: Sequence[bytes], cached: Set[bytes]) -> int:
    """Leading blocks of a prompt's chain `hashes` found in `cached` (a chain: block i cached means the
    blocks before it are)."""
    n = 0
    while n < len(hashes) and hashes[n] in cached:
        n += 1
    return n


def cached_tokens(blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens `blocks` cached blocks serve: never the last token (the engine computes it)."""
    return min(blocks * block_size, prompt_tokens - 1)


def infinite_cache_share(prompts: Sequence[Sequence[int]], block_size: int) -> float:
    """Prompt tokens an unbounded prefix cache shared by every replica would serve, over all prompt
    tokens: per request, its longest prefix of full blocks any earlier prompt had (never its last
    token: the engine always computes that one)."""
    root, seen, cached, total = root_hash("bound"), set(), 0, 0
    for ids in prompts:
        hashes = cacheable_block_hashes(ids, block_size, root)
        cached += cached_tokens(leading_blocks(hashes, seen), len(ids), block_size)
        total += len(ids)
        seen.update(hashes)
    return cached / total if total else 0.0


def trace_workload(
    name: str,
    start_s: float,
    window_s: float,
    speedup: float,
    rate: float,
    token_scale: float,
    output_scale: float,
    max_output: int,
    max_prompt: int,
    block_size: int,
    seed: int = 0,
    at_ticks: bool = False,
) -> TraceWorkload:
    """The trace's window [start_s, start_s + window_s), `speedup` times faster, `rate` times the
    users (rate_scaled: copies share nothing with the originals), prompts and prefix blocks
    `token_scale` times as long (cut at `max_prompt` tokens: a cut keeps the prefix), answers
    `output_scale` times as long (1 to `max_output` tokens, EOS ignored). A trace recorded at ticks
    (Mooncake's: 3 s) has each tick's requests spread over it (RequestTrace.spread_ticks) unless
    `at_ticks`: then they are sent together at the tick, as recorded."""
    trace = load_request_trace(bundled(name))
    trace = trace if at_ticks else trace.spread_ticks(seed)
    trace = trace.window(start_s, start_s + window_s).time_scaled(speedup)
    if rate != 1.0:
        trace = trace.rate_scaled(rate, seed)
    prompts = [prompt_token_ids(trace, i, TOKEN_RANGE, token_scale, seed)[:max_prompt] for i in range(len(trace))]
    outputs = [max(1, min(max_output, round(int(n) * output_scale))) for n in trace.output_tokens]
    requests = [BenchRequest(prompt=p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, outputs)]
    share, prompt_tokens = infinite_cache_share(prompts, block_size), sum(map(len, prompts))
    description = {
        **trace.describe(),
        "prompt_tokens_mean": prompt_tokens / max(1, len(prompts)),
        "output_tokens_mean": sum(outputs) / max(1, len(outputs)),
        "token_scale": token_scale,
        # What any fleet must prefill even with an infinite cache: how busy the trace keeps it.
        "uncached_prompt_tokens_per_s": (1 - share) * prompt_tokens / max(1e-9, trace.duration_s),
    }
    return TraceWorkload(requests, [float(t) for t in trace.t_s], share, description)
