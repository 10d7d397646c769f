"""`python -m load_tests.calibrate_sim`: fits a simulation preset's step-time model to this engine.

Runs the real engine on decode batches of several sizes over prompts of several lengths (prefill
steps included), records each step's (prefill tokens, decoding sequences, context tokens) and its
measured forward time, and fits step time = fixed + a x prefill + b x decoding + c x context by least
squares. Prints the coefficients to put in a `batcher.simulated` preset, and the fit's error.
"""
from __future__ import annotations

import argparse
import time
from typing import List, Optional, Sequence, Tuple

import torch

from batcher import EngineConfig, LLMEngine, SamplingParams
from batcher.simulated import step_features
from load_tests.workload import random_prompts, text_token_range

Sample = Tuple[int, int, int, float]  # prefill tokens, decoding sequences, context tokens, seconds


def record_steps(engine: LLMEngine, batches: Sequence[int], prompt_lens: Sequence[int], max_tokens: int,
                 seed: int) -> List[Sample]:
    samples: List[Sample] = []
    execute = engine.runner.execute

    def timed(scheduled):
        t0 = time.perf_counter()
        logits = execute(scheduled)
        samples.append((*step_features(scheduled), time.perf_counter() - t0))
        return logits

    engine.runner.execute = timed
    vocab = text_token_range(engine.tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for batch in batches:
        for n in prompt_lens:
            engine.generate(random_prompts(batch, n, vocab, seed + batch * 1000 + n), params)
            print(f"  batch {batch:3d} x {n:4d} prompt tokens: {len(samples)} steps so far", flush=True)
    engine.runner.execute = execute
    return samples


def fit(samples: List[Sample]) -> Tuple[List[float], float]:
    """Coefficients (fixed, prefill, decode, context) minimising the squared relative error (so
    short decode steps weigh as much as long prefills), and the mean relative error."""
    x = torch.tensor([[1.0, p, d, c] for p, d, c, _ in samples], dtype=torch.float64)
    y = torch.tensor([s for *_, s in samples], dtype=torch.float64)
    coef = torch.linalg.lstsq(x / y.unsqueeze(1), torch.ones_like(y).unsqueeze(1)).solution.squeeze(1)
    error = ((x @ coef - y).abs() / y).mean().item()
    return coef.tolist(), error


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m load_tests.calibrate_sim", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,8,24,64")
    p.add_argument("--prompt-lens", default="32,192")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads, device="cpu", dtype="float32",
                                    enable_prefix_caching=False))
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    record_steps(engine, [1], [16], 4, args.seed)  # warm-up, not fitted
    samples = record_steps(engine, ints(args.batches), ints(args.prompt_lens), args.max_tokens, args.seed)
    (fixed, prefill, decode, context), error = fit(samples)
    print(f"{len(samples)} steps fitted, mean relative error {error:.1%}")
    print(f"StepTimeModel(fixed_s={fixed:.3g}, prefill_token_s={prefill:.3g}, decode_seq_s={decode:.3g}, "
          f"context_token_s={context:.3g})")
    return {"fixed_s": fixed, "prefill_token_s": prefill, "decode_seq_s": decode, "context_token_s": context,
            "mean_relative_error": error, "steps": len(samples)}


if __name__ == "__main__":
    main()
