"""Paged KV cache plugged into unmodified Hugging Face decoder models.

The model runs on one packed row of tokens (batch 1, T tokens from many sequences). Our attention
function, registered with transformers' AttentionInterface, hands each layer's query and new K/V to
`torch.ops.iterserve.paged_attention` (batcher/attention/op.py), which writes K/V into cache slots and
attends over each sequence's cached blocks. The per-step tensors it needs travel in `PagedMetadata`
through the model's kwargs, built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AttentionInterface

import batcher.attention  # noqa: F401  registers torch.ops.iterserve.paged_attention
from batcher.attention import cpu_kernel
from batcher.model_files import kv_geometry

ATTENTION_NAME = "iterserve_paged"


class KVCache:
    """One K and one V tensor per layer, shaped ((num_blocks + 1) * block_size, num_kv_heads, head_dim).

    Blocks 0..num_blocks-1 belong to the block manager; the extra last block is scratch that is never
    handed to a sequence: padding tokens of a bucketed step write their K/V there (`scratch_slot`).
    """

    def __init__(self, model_config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        num_layers, num_kv_heads, head_dim = kv_geometry(model_config)
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def copy_blocks(self, pairs) -> None:
        """Copies every layer's K/V of each (source, copy) block pair (a fork's partial last block)."""
        if not pairs:
            return
        bs = self.block_size
        src, dst = (torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks]) for blocks in zip(*pairs))
        with torch.no_grad():
            for cache in self.k + self.v:
                cache.index_copy_(0, dst.to(cache.device), cache.index_select(0, src.to(cache.device)))


@dataclass
class PagedMetadata:
    """One step's attention inputs, shared by every layer (the op's contract, batcher/attention/op.py)."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (T,) int64 cache slot of each packed token (padding: scratch slot)
    query_start: torch.Tensor  # (B+1,) int32 each sequence's first row in the packed tokens
    context_lens: torch.Tensor  # (B,) int32 tokens cached per sequence after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    backend: str  # "reference" | "cpu" | "triton" (resolved, never "auto")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    paged_metadata: Optional[PagedMetadata] = None,
    **kwargs,
):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D)."""
    meta = paged_metadata
    if meta is None:
        raise RuntimeError(f"the '{ATTENTION_NAME}' attention needs paged_metadata (run it via ModelRunner)")
    cache = meta.kv_cache
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    args = (
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cache.k[module.layer_idx],
        cache.v[module.layer_idx],
        meta.slot_mapping,
        meta.query_start,
        meta.context_lens,
        meta.block_tables,
        cache.block_size,
        float(scale),
    )
    if meta.backend == "cpu" and cpu_kernel.fits(args[0], args[3]):
        out = torch.ops.iterserve_cpu.paged_attention(*args)  # the C++ op itself: no Python per layer
    else:
        out = torch.ops.iterserve.paged_attention(*args, meta.backend)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
