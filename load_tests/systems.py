"""The baselines of the offline benchmark, all on one Hugging Face model instance.

Every system takes a list of `WorkloadRequest`s and returns a `RunResult` whose `outputs[i]` holds exactly
the tokens request i asked for (what counts as output). Greedy decoding and EOS ignored everywhere, so
every system does the same work and outputs can be compared token for token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence

import torch

from load_tests.workload import WorkloadRequest


@dataclass(frozen=True)
class Budgets:
    """Per-step and KV budgets shared by the batching systems (ours and transformers')."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int


@dataclass
class RunResult:
    wall_seconds: float
    outputs: List[List[int]]
    metrics: dict = field(default_factory=dict)  # system-specific extras (engine forward share, ...)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


class System(Protocol):
    name: str

    def warmup(self, requests: Sequence[WorkloadRequest]) -> None: ...

    def run(self, requests: Sequence[WorkloadRequest]) -> RunResult: ...

    def close(self) -> None: ...


def load_hf_model(name: str):
    """The baselines' model: fp32 on CPU, EOS disabled so `generate` always runs to max_new_tokens."""
    from batcher.model_loader import load_model

    model, tokenizer = load_model(name, torch.float32, torch.device("cpu"))
    model.generation_config.eos_token_id = None  # ignore EOS (the workload fixes every output length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.generation_config.pad_token_id = pad
    return model, tokenizer


class HFNaive:
    """`model.generate` one request at a time: the Anyscale article's naive baseline."""

    name = "hf_naive"

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def _one(self, request: WorkloadRequest) -> List[int]:
        ids = torch.tensor([request.prompt_token_ids])
        # An explicit mask: HF would otherwise mask prompt tokens that equal the pad id.
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens, do_sample=False
        )
        return out[0, ids.shape[1] :].tolist()

    def warmup(self, requests: Sequence[WorkloadRequest]) -> None:
        for r in requests:
            self._one(r)

    def run(self, requests: Sequence[WorkloadRequest]) -> RunResult:
        start = time.perf_counter()
        outputs = [self._one(r) for r in requests]
        return RunResult(time.perf_counter() - start, outputs)

    def close(self) -> None:
        pass


class HFStatic:
    """`model.generate` on fixed, left-padded batches in arrival order, each run to its longest request.

    Only each request's own requested tokens count as output: the tokens generated past a request's
    length while it waits for the batch's longest one are the waste static batching pays.
    """

    name = "hf_static16"

    def __init__(self, model, pad_token_id: int, batch_size: int = 16):
        self.model, self.pad, self.batch_size = model, pad_token_id, batch_size
        self.generated_per_batch: List[int] = []  # tokens actually generated per row (batch max)

    @torch.inference_mode()
    def _batch(self, batch: Sequence[WorkloadRequest]) -> List[List[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n :] = 1
        longest = max(r.max_tokens for r in batch)
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False)
        new = out[:, width:]
        self.generated_per_batch.append(new.shape[1])
        return [new[row, : r.max_tokens].tolist() for row, r in enumerate(batch)]

    def _all(self, requests: Sequence[WorkloadRequest]) -> List[List[int]]:
        outputs: List[List[int]] = []
        for i in range(0, len(requests), self.batch_size):
            outputs += self._batch(requests[i : i + self.batch_size])
        return outputs

    def warmup(self, requests: Sequence[WorkloadRequest]) -> None:
        self._all(requests)

    def run(self, requests: Sequence[WorkloadRequest]) -> RunResult:
        self.generated_per_batch = []
        start = time.perf_counter()
        outputs = self._all(requests)
        wall = time.perf_counter() - start
        generated = sum(
            g * len(requests[i * self.batch_size : (i + 1) * self.batch_size])
            for i, g in enumerate(self.generated_per_batch)
        )
        # Share of generated tokens some request asked for: 1 - the padding waste of static batching.
        useful = sum(len(o) for o in outputs) / generated if generated else 0.0
        return RunResult(wall, outputs, {"generated_tokens": generated, "useful_token_share": useful})

    def close(self) -> None:
        pass


class TransformersCB:
    """transformers' own continuous batching (`generation/continuous_batching`), with our budgets.

    `generate_batch` takes one max_new_tokens for all requests, so this drives the manager it wraps
    directly: `add_request` accepts a per-request max_new_tokens and eos_token_id (-1 = none).
    Budget mapping: max_requests_per_batch = max_num_seqs, max_batch_tokens = max_num_batched_tokens,
    page_size = block_size, num_blocks = num_kv_blocks (a transformers block is page_size tokens of K
    and V for every layer, as ours). Block sharing (its prefix cache) is off, like ours here.
    """

    name = "transformers_cb"

    def __init__(self, model, budgets: Budgets):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = model
        self.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        self.cb_config = ContinuousBatchingConfig(
            page_size=budgets.block_size,
            num_blocks=budgets.num_kv_blocks,
            max_batch_tokens=budgets.max_num_batched_tokens,
            max_requests_per_batch=budgets.max_num_seqs,
            allow_block_sharing=False,
        )
        self.resolved: Optional[dict] = None
        # Its per-run INFO/WARNING chatter (warmup, prefix sharing) would drown the benchmark's output.
        logging.getLogger("transformers.generation.continuous_batching").setLevel(logging.ERROR)

    def run(self, requests: Sequence[WorkloadRequest]) -> RunResult:
        # No inference_mode here: the manager's thread updates tensors it created in place.
        # A fresh manager per run (outside the timed region: it allocates the KV cache and warms up),
        # as generate_batch does; timing starts when requests are handed over.
        manager = self.model.init_continuous_batching(
            generation_config=self.generation_config, continuous_batching_config=self.cb_config
        )
        manager.warmup()
        cache = manager.batch_processor.cache
        self.resolved = {
            "num_blocks": cache.num_blocks,
            "max_batch_tokens": cache.max_batch_tokens,
            "page_size": self.cb_config.page_size,
            "max_requests_per_batch": manager.continuous_batching_config.max_requests_per_batch,
        }
        results = {}
        try:
            start = time.perf_counter()
            manager.start()
            for i, r in enumerate(requests):
                manager.add_request(
                    list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1
                )
            while len(results) < len(requests):
                out = manager.get_result(timeout=1.0)
                if out is not None and out.is_finished():
                    if out.error is not None:
                        raise RuntimeError(f"transformers CB failed {out.request_id}: {out.error}")
                    results[out.request_id] = out.generated_tokens
                elif out is None and not manager.is_running():
                    raise RuntimeError("transformers CB generation thread died")
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True)
            manager.destroy()
        return RunResult(wall, [list(results[f"r{i}"]) for i in range(len(requests))], {"resolved": self.resolved})

    def warmup(self, requests: Sequence[WorkloadRequest]) -> None:
        self.run(requests)

    def close(self) -> None:
        pass
