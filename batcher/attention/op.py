"""`torch.ops.iterserve.paged_attention`: one opaque call per layer, so a compiled model keeps it whole.

Contract (every implementation follows it; tests/test_paged_attention_op.py checks them against the
reference):
- query (T, H, D); key, value (T, Hkv, D), H % Hkv == 0.
- k_cache, v_cache (num_slots, Hkv, D), num_slots = num_blocks * block_size. Mutated: key/value rows
  are first written to slots `slot_mapping` (T,) int64.
- query_start (B+1,) int32: sequence b's queries are rows query_start[b]:query_start[b+1]; rows from
  query_start[B] on are padding: their output is zero (their slots point at a scratch block).
- context_lens (B,) int32: tokens cached for b after this step; query i of b sits at position
  context_lens[b] - q_len_b + i and sees keys 0..that position through block_tables (B, max_blocks)
  int32 (padded with 0).
- Returns (T, H, D) in query's dtype.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BACKENDS = ("reference", "cpu", "triton")


@torch.library.custom_op("iterserve::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    backend: str,
) -> torch.Tensor:
    args = (
        query,
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        query_start,
        context_lens,
        block_tables,
        block_size,
        scale,
    )
    if backend == "reference":
        from batcher.attention.reference import reference_paged_attention

        return reference_paged_attention(*args)
    if backend == "cpu":
        from batcher.attention.cpu_kernel import cpu_paged_attention

        return cpu_paged_attention(*args)
    if backend == "triton":
        from batcher.attention.triton_paged import triton_paged_attention

        return triton_paged_attention(*args)
    raise ValueError(f"unknown paged-attention backend {backend!r}; expected one of {BACKENDS}")


@paged_attention.register_fake
def _(
    query,
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    query_start,
    context_lens,
    block_tables,
    block_size,
    scale,
    backend,
):
    return query.new_empty(query.shape)


def resolve_backend(name: str, device: torch.device) -> str:
    """'auto' -> the implementation to use on `device`; an explicit name is checked and kept. Builds
    (or loads the cached build of) the CPU kernel when it is chosen, so the first step does not."""
    if name == "auto":
        if device.type == "cpu":
            try:
                from batcher.attention import cpu_kernel

                cpu_kernel.build()
                return "cpu"
            except Exception as e:  # no compiler here: the reference is slower but runs anywhere
                log.warning("paged attention: the CPU kernel did not build (%s); using the reference", e)
                return "reference"
        # Triton: greedy float32 tokens equal HF's on an H100, eager and under CUDA graphs (docs/forward.md).
        try:
            import triton  # noqa: F401  (CUDA builds of torch ship it)

            return "triton"
        except ImportError as e:
            log.warning("paged attention: triton is not importable (%s); using the reference", e)
            return "reference"
    if name not in BACKENDS:
        raise ValueError(f"unknown paged-attention backend {name!r}; expected 'auto' or one of {BACKENDS}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError("attention_backend 'cpu' runs on CPU tensors only")
    if name == "triton" and device.type != "cuda":
        raise ValueError("attention_backend 'triton' needs a CUDA device (tests run it under TRITON_INTERPRET=1)")
    if name == "cpu":
        from batcher.attention import cpu_kernel

        cpu_kernel.build()
    return name
