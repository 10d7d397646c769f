"""This project's engine (batcher.LLMEngine) as a benchmark system: static or continuous scheduling,
with the eager fp32 forward (the reference the engine had before the fast forward) or the fast one."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from load_tests.systems import Budgets, RunResult
from load_tests.workload import WorkloadRequest


class EngineSystem:
    """One LLMEngine, kept across runs; its stats are diffed around each timed run.

    Prefix caching is off: prompts are random (no shared prefixes within a run), and the same prompts
    recur across caps, so cached blocks from an earlier run would flatter later ones.
    """

    def __init__(
        self,
        model: str,
        budgets: Budgets,
        scheduling: str,
        static_batch_size: int = 16,
        fast: bool = False,
        quantization: Optional[str] = None,
    ):
        from batcher import EngineConfig, LLMEngine

        self.name = "engine_fast" if fast else f"engine_{scheduling}"
        # Eager fp32 with the gather + SDPA attention, or the engine's defaults (dtype, compile and
        # attention "auto").
        forward = {} if fast else {"dtype": "float32", "compile": "off", "attention_backend": "reference"}
        self.config = EngineConfig(
            model=model,
            device="cpu",
            quantization=quantization,
            **forward,
            max_num_seqs=budgets.max_num_seqs,
            max_num_batched_tokens=budgets.max_num_batched_tokens,
            block_size=budgets.block_size,
            num_kv_blocks=budgets.num_kv_blocks,
            enable_prefix_caching=False,
            scheduling=scheduling,
            static_batch_size=static_batch_size,
        )
        self.engine = LLMEngine(self.config)

    def _generate(self, requests: Sequence[WorkloadRequest]):
        from batcher import SamplingParams

        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        return self.engine.generate([list(r.prompt_token_ids) for r in requests], params)

    def warmup(self, requests: Sequence[WorkloadRequest]) -> None:
        self._generate(requests)

    def run(self, requests: Sequence[WorkloadRequest]) -> RunResult:
        before = self.engine.stats()
        start = time.perf_counter()
        completions = self._generate(requests)
        wall = time.perf_counter() - start
        after = self.engine.stats()
        steps = after.steps - before.steps
        forward = after.forward_seconds - before.forward_seconds
        step_time = after.step_seconds - before.step_seconds
        metrics = {
            "steps": steps,
            "forward_seconds": forward,
            "step_seconds": step_time,
            # The targets: time inside the model forward over the whole generate() wall time, and the
            # per-step share of allocated KV slots holding real tokens, averaged over steps.
            "forward_share": forward / wall if wall > 0 else 0.0,
            "step_share": step_time / wall if wall > 0 else 0.0,
            "kv_slot_use": (after.kv_slot_use_sum - before.kv_slot_use_sum) / steps if steps else 0.0,
            "preemptions": after.preemptions - before.preemptions,
            "mean_tokens_per_step": ((after.tokens_computed - before.tokens_computed) / steps if steps else 0.0),
        }
        return RunResult(wall, [list(c.token_ids) for c in completions], metrics)

    def close(self) -> None:
        close = getattr(self.engine, "close", None) or getattr(self.engine, "shutdown", None)
        if callable(close):
            close()
