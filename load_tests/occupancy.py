"""The seeds' batch-occupancy picture from real engine runs: the same requests through the engine in
static and in continuous mode with the occupancy trace on (EngineConfig.trace_steps), same slot count.

Requests arrive together with capped-exponential output lengths (EOS ignored), so static batches
wait for their longest member while continuous batching refills a slot the step after it frees.
"""

from __future__ import annotations

import gc
from typing import List, Tuple

from batcher.trace import OccupancyTrace
from load_tests.workload import capped_lengths, exponential_draws, random_prompts, text_token_range


def trace_run(
    model: str,
    scheduling: str,
    prompts: List[List[int]],
    lengths: List[int],
    slots: int,
    threads: int = 0,
    max_steps: int = 4000,
) -> Tuple[OccupancyTrace, dict]:
    """Runs the requests to completion in one engine; returns its trace and a few counters."""
    from batcher import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        model=model,
        device="cpu",
        dtype="float32",
        max_num_seqs=slots,
        static_batch_size=slots,
        scheduling=scheduling,
        enable_prefix_caching=False,
        trace_steps=max_steps,
        num_threads=threads or None,
    )
    engine = LLMEngine(config)
    try:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        outs = engine.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == list(lengths), "every request gets its requested length"
        trace = engine.trace
        stats = {
            "scheduling": scheduling,
            "slots": slots,
            "steps": engine.counters.steps,
            "generated_tokens": engine.counters.generated_tokens,
            "step_seconds": engine.counters.step_seconds,
            "slot_utilization": trace.utilization(slots),
        }
        return trace, stats
    finally:
        del engine
        gc.collect()


def occupancy_pair(
    model: str,
    num_requests: int = 24,
    slots: int = 8,
    prompt_len: int = 16,
    mean_output: float = 12.0,
    cap: int = 48,
    seed: int = 0,
    threads: int = 0,
) -> List[Tuple[str, OccupancyTrace, dict]]:
    """Static, then continuous, on the same requests: [(label, trace, stats)]."""
    from batcher.model_files import load_tokenizer

    prompts = random_prompts(num_requests, prompt_len, text_token_range(load_tokenizer(model)), seed)
    lengths = capped_lengths(exponential_draws(num_requests, mean_output, seed), cap)
    out = []
    for mode in ("static", "continuous"):
        trace, stats = trace_run(model, mode, prompts, lengths, slots, threads)
        label = (
            f"{mode}: {stats['steps']} steps, {stats['slot_utilization']:.0%} of slot-steps busy, "
            f"{stats['step_seconds']:.1f} s"
        )
        out.append((label, trace, stats))
    return out
