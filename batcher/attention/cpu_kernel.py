"""The CPU implementation: a C++ kernel (batcher/native/paged_attention.cpp, built once at start-up by
batcher.native). It reads K/V through the block tables a 16-key tile at a time (no gathered history, no
dense mask), with an online softmax in float32 for fp32, bf16 and fp16 caches.

The compiled forward calls the C++ op `torch.ops.iterserve_cpu.paged_attention` directly (`fits`
says when): through the Python custom op it cost ~60 us more per layer, ~2 ms of a 135M model's
decode step.
"""

from __future__ import annotations

import functools

import torch

from batcher import native


@functools.lru_cache(maxsize=None)
def build() -> None:
    """Builds (or loads) the kernel and gives its op a fake implementation, so torch.compile can trace
    the direct call; resolve_backend calls it at start-up."""
    native.build("paged_attention.cpp")
    torch.library.register_fake("iterserve_cpu::paged_attention")(_fake)


def _fake(
    query, key, value, k_cache, v_cache, slot_mapping, query_start, context_lens, block_tables, block_size, scale
):
    return query.new_empty(query.shape)


MAX_HEAD_DIM = 256  # the kernel's fixed buffers (paged_attention.cpp: MAX_D, MAX_Q)
MAX_GROUP = 48


def fits(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel's fixed buffers hold this geometry (head dim, query heads per KV head)."""
    return query.shape[-1] <= MAX_HEAD_DIM and query.shape[1] // k_cache.shape[1] <= MAX_GROUP


def cpu_paged_attention(
    query,
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    query_start,
    context_lens,
    block_tables,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    if not fits(query, k_cache):
        from batcher.attention.reference import reference_paged_attention  # geometry it cannot hold

        return reference_paged_attention(
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
    build()
    return torch.ops.iterserve_cpu.paged_attention(
        query, key, value, k_cache, v_cache, slot_mapping, query_start, context_lens, block_tables, block_size, scale
    )
