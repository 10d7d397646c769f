"""Runs one scheduled step through the model: packs the batch and its paged-attention metadata into
buffers allocated once, runs the (compiled or eager) forward, returns the logits of the sequences
that sample this step."""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from batcher.attention import resolve_backend
from batcher.compiled_forward import StepForward, build_step_forward
from batcher.cpu_linear import use_kernel_linears, use_weight_major_linears
from batcher.lora_layers import LoRAModel
from batcher.paged_attention import ATTENTION_NAME, KVCache, PagedMetadata
from batcher.precompiled_forward import precompile_key
from batcher.scheduler import ScheduledSeq

# A compiled step has at least this many token rows and sampled rows: dynamo specialises sizes 0 and 1,
# so without it one-token decode steps would compile (and keep) a second graph.
MIN_ROWS = 2


def padded_rows(n: int, cuda_graphs: bool) -> int:
    """Rows a compiled step runs for n real ones. On CPU any n >= 2 shares the one dynamic graph, so
    padding further only wastes compute; CUDA graphs are recorded per size, so there n is rounded up
    to a power of two (a handful of recordings, at most 2x the rows)."""
    n = max(n, MIN_ROWS)
    return 1 << (n - 1).bit_length() if cuda_graphs else n


class StepBuffers:
    """One step's inputs at their largest shapes, filled in place each step (pinned on the host when
    the model is on a GPU, then one copy each). The attention metadata keeps its full shapes,
    max_num_seqs sequences and the widest block table, with trailing sequences of no tokens, so the
    compiled forward sees the same shapes every step."""

    def __init__(self, max_tokens: int, max_samples: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"

        def host(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.host = {
            "input_ids": host(max_tokens),
            "positions": host(max_tokens),
            "slot_mapping": host(max_tokens),
            "sample_index": host(max_samples),
            "query_start": host(max_seqs + 1, dtype=torch.int32),
            "context_lens": host(max_seqs, dtype=torch.int32),
            "block_tables": host(max_seqs, max_blocks, dtype=torch.int32),
        }
        self.dev = self.host if device.type == "cpu" else {k: v.to(device) for k, v in self.host.items()}
        self.np = {k: v.numpy() for k, v in self.host.items()}

    def to_device(self, num_tokens: int, num_samples: int) -> None:
        """Asynchronous copies: the host buffers are written again only after this step's logits were
        read back (a sync), so a copy never races the next step's writes."""
        if self.dev is self.host:
            return
        sizes = {
            "input_ids": num_tokens,
            "positions": num_tokens,
            "slot_mapping": num_tokens,
            "sample_index": num_samples,
        }
        for k, h in self.host.items():
            n = sizes.get(k)
            (self.dev[k] if n is None else self.dev[k][:n]).copy_(h if n is None else h[:n], non_blocking=True)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
        compile: str = "off",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: Optional[int] = None,
        thread_counts: Iterable[int] = (),
        freezing: bool = False,
        lora: Optional[LoRAModel] = None,
    ):
        """compile: EngineConfig.compile ('auto' | 'off'; 'inductor' requires it). thread_counts: the
        torch thread counts steps will run with (dynamo keeps one graph per thread count; each is
        compiled at start). freezing: inductor's, see batcher/compiled_forward.py."""
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model
        self.device = device
        self.block_size = block_size
        self.attention_backend = resolve_backend(attention_backend, device)
        self.kv_cache = KVCache(model.config, num_blocks, block_size, dtype, device)
        max_len = max_model_len or model.config.max_position_embeddings
        self.buffers = StepBuffers(
            padded_rows(max(max_num_batched_tokens, max_num_seqs), True),
            padded_rows(max_num_seqs, True),
            max_num_seqs,
            min(-(-max_len // block_size), num_blocks),
            device,
        )
        self.max_num_seqs = max_num_seqs
        self.lora = lora
        if device.type == "cpu" and dtype == torch.bfloat16:
            use_kernel_linears(model)  # oneDNN's bf16 GEMM reads weights at half the kernel's speed at decode
        # CUDA graphs need a kernel with no host sync inside: only the Triton backend (CUDA's `auto`) is;
        # the graphs mutate the KV cache in place, at addresses fixed from now on.
        cuda_graphs = device.type == "cuda" and self.attention_backend == "triton"
        if cuda_graphs:
            for t in self.kv_cache.k + self.kv_cache.v:
                torch._dynamo.mark_static_address(t)
        threads = set(thread_counts) | {torch.get_num_threads()}
        # One graph (no adapters' second graph, one thread count) on CPU is saved whole, so a warm start
        # does not trace the model again.
        key = (
            self._precompile_key(dtype, threads, freezing)
            if (compile != "off" and lora is None and len(threads) == 1 and device.type == "cpu")
            else None
        )
        self.forward: StepForward = build_step_forward(
            model, compile, lambda fwd: self._warm_up(fwd, thread_counts), device, cuda_graphs, freezing, key
        )
        if self.forward.mode == "eager" and device.type == "cpu" and dtype == torch.float32:
            use_weight_major_linears(model)  # eager fp32 MKL's x @ W^T is slow at decode-sized batches

    def _precompile_key(self, dtype: torch.dtype, threads: set, freezing: bool) -> str:
        """The saved step's key: the model, and this runner's facts its graph depends on."""
        return precompile_key(
            self.model,
            {
                "dtype": dtype,
                "device": self.device,
                "backend": self.attention_backend,
                "threads": threads,
                "freezing": freezing,
                "block_size": self.block_size,
                "kv_cache": tuple(self.kv_cache.k[0].shape),
                "int8_kernel": any(getattr(m, "cpu_kernel", False) for m in self.model.modules()),
                "buffers": {k: tuple(v.shape) for k, v in self.buffers.host.items()},
            },
        )

    @torch.inference_mode()
    def _warm_up(self, forward: StepForward, thread_counts: Iterable[int]) -> None:
        """Runs steps of padding only (no sequence: the op writes the scratch slot and returns zeros)
        under each thread count, so compiling happens now and not in a request; with CUDA graphs, one
        step per decode-sized bucket, so each graph is recorded now."""
        before = torch.get_num_threads()
        self.forward = forward
        top = padded_rows(self.max_num_seqs, True) if forward.cuda_graphs else MIN_ROWS
        try:
            for n in sorted(set(thread_counts) | {before}):
                torch.set_num_threads(n)
                rows = MIN_ROWS
                while rows <= top:
                    self._run(num_tokens=0, num_seqs=0, num_samples=0, rows=rows)
                    if self.lora is not None:  # the graph of steps with adapter tokens (a mask of zeros here)
                        self._run(num_tokens=0, num_seqs=0, num_samples=0, rows=rows, token_slots=[])
                    rows *= 2
        finally:
            torch.set_num_threads(before)

    @torch.inference_mode()
    def execute(self, scheduled: List[ScheduledSeq], lora_slots: Optional[List[int]] = None) -> torch.Tensor:
        """Computes K/V for every scheduled token; returns (num_sampling_seqs, vocab) float logits.
        lora_slots: each scheduled sequence's adapter slot (-1: base), when any runs with an adapter."""
        bs, np_ = self.block_size, self.buffers.np
        input_ids: List[int] = []
        positions: List[int] = []
        slots: List[int] = []
        sample_index: List[int] = []
        query_start, context_lens, tables = np_["query_start"], np_["context_lens"], np_["block_tables"]
        for b, s in enumerate(scheduled):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start[b + 1] = len(input_ids)
            context_lens[b] = end
            used = -(-end // bs)
            tables[b, :used] = table[:used]  # columns past `used` are never read
            if s.samples:
                sample_index.append(len(input_ids) - 1)
        T, S = len(input_ids), len(sample_index)
        np_["input_ids"][:T] = input_ids
        np_["positions"][:T] = positions
        np_["slot_mapping"][:T] = slots
        np_["sample_index"][:S] = sample_index
        token_slots = (
            None
            if lora_slots is None
            else [slot for s, slot in zip(scheduled, lora_slots) for _ in range(s.num_new_tokens)]
        )
        logits = self._run(T, len(scheduled), S, token_slots=token_slots)
        return logits.float()

    def _run(
        self, num_tokens: int, num_seqs: int, num_samples: int, rows: int = 0, token_slots: Optional[List[int]] = None
    ) -> torch.Tensor:
        """Pads the filled buffers to the forward's shapes (at least `rows` rows), runs it, returns the
        real rows' logits. token_slots: each token's LoRA slot (-1: base), None when none has one."""
        buf, np_ = self.buffers, self.buffers.np
        compiled = self.forward.mode != "eager"
        graphs = self.forward.cuda_graphs
        T = padded_rows(max(num_tokens, rows), graphs) if compiled else num_tokens
        S = padded_rows(max(num_samples, rows), graphs) if compiled else max(num_samples, 1)
        np_["query_start"][num_seqs + 1 :] = num_tokens  # trailing sequences have no tokens...
        np_["context_lens"][num_seqs:] = 0  # ...and no context
        np_["input_ids"][num_tokens:T] = 0  # padding rows: token 0 at position 0, written to scratch
        np_["positions"][num_tokens:T] = 0
        np_["slot_mapping"][num_tokens:T] = self.kv_cache.scratch_slot
        np_["sample_index"][num_samples:S] = 0  # logits of row 0, dropped below
        buf.to_device(T, S)
        d = buf.dev
        if compiled:
            seqs, width = d["query_start"].shape[0] - 1, d["block_tables"].shape[1]
        else:  # eager: the exact batch, as small as it is
            seqs = num_seqs
            width = max((-(-int(c) // self.block_size) for c in np_["context_lens"][:num_seqs]), default=1)
        meta = PagedMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=d["slot_mapping"][:T],
            query_start=d["query_start"][: seqs + 1],
            context_lens=d["context_lens"][:seqs],
            block_tables=d["block_tables"][:seqs, :width],
            backend=self.attention_backend,
        )
        if self.lora is not None:
            self.lora.set_step(token_slots, T, compiled)
        logits = self.forward(d["input_ids"][:T], d["positions"][:T], d["sample_index"][:S], meta)
        return logits[:num_samples]
