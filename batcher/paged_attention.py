"""Paged KV cache plugged into unmodified Hugging Face decoder models.

The model runs on one packed row of tokens (batch 1, T tokens from many sequences). Our attention
function, registered with transformers' AttentionInterface, writes each layer's new K/V into cache
slots and attends over the cached blocks of each sequence. Everything per-sequence is precomputed
once per step into `PagedMetadata`, so each layer does a fixed handful of batched tensor ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "iterserve_paged"


def kv_geometry(model_config) -> Tuple[int, int, int]:
    """(layers, KV heads, head dim) of a HF decoder config."""
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, head_dim


class KVCache:
    """One K and one V tensor per layer, shaped (num_blocks * block_size, num_kv_heads, head_dim)."""

    def __init__(self, model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        num_layers, num_kv_heads, head_dim = kv_geometry(model_config)
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        num_layers, num_kv_heads, head_dim = kv_geometry(model_config)
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass
class AttentionGroup:
    """Sequences attended together, each padded to `Q` queries and `L` cached keys.

    Decoding sequences (one query each) form one group and prefill chunks another, so a long
    prompt chunk does not pad every decode row to its length.
    """

    q_index: torch.Tensor  # (B, Q) positions in the packed row; padding points at 0
    block_table: torch.Tensor  # (B, num_blocks) padded with block 0
    mask: torch.Tensor  # (B, 1, G*Q, L) bool: query may see key
    valid: torch.Tensor  # (B*Q,) bool: which padded queries are real


@dataclass
class PagedMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each packed token
    groups: List[AttentionGroup]


def build_group(q_start: List[int], q_len: List[int], context_len: List[int],
                block_tables: List[List[int]], block_size: int, gqa_groups: int,
                device: torch.device) -> AttentionGroup:
    """q_start/q_len: each sequence's tokens in the packed row; context_len: tokens cached after
    this step (its new tokens included); block_tables: block ids covering context_len."""
    B, Q = len(q_len), max(q_len)
    num_blocks = max(len(t) for t in block_tables)
    L = num_blocks * block_size
    ar_q = torch.arange(Q)
    q_len_t = torch.tensor(q_len)
    valid = ar_q[None, :] < q_len_t[:, None]  # (B, Q)
    q_index = torch.where(valid, torch.tensor(q_start)[:, None] + ar_q[None, :], 0)
    # Absolute position of each query; padded ones see only key 0 (no empty softmax rows).
    q_pos = torch.where(valid, (torch.tensor(context_len) - q_len_t)[:, None] + ar_q[None, :], 0)
    mask = torch.arange(L)[None, None, :] <= q_pos[:, :, None]  # (B, Q, L)
    mask = mask[:, None, None].expand(B, 1, gqa_groups, Q, L).reshape(B, 1, gqa_groups * Q, L)
    table = torch.tensor([t + [0] * (num_blocks - len(t)) for t in block_tables])
    return AttentionGroup(
        q_index=q_index.to(device), block_table=table.to(device), mask=mask.to(device),
        valid=valid.reshape(-1).to(device),
    )


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                            scaling: Optional[float] = None, dropout: float = 0.0,
                            paged_metadata: Optional[PagedMetadata] = None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) -> (1, T, H, D)."""
    meta = paged_metadata
    if meta is None:
        raise RuntimeError(f"the '{ATTENTION_NAME}' attention needs paged_metadata (run it via ModelRunner)")
    cache = meta.kv_cache
    k_cache, v_cache = cache.k[module.layer_idx], cache.v[module.layer_idx]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    _, H, T, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    q_packed = query[0].transpose(0, 1)  # (T, H, D)
    out = query.new_empty(T, H, D)
    bs = cache.block_size
    for g in meta.groups:
        B, Q = g.q_index.shape
        # Query heads sharing a KV head go side by side, so K/V never need repeating (GQA).
        q = q_packed[g.q_index].view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
        # index_select copies whole blocks; advanced indexing (cache[table]) is 2-3x slower on CPU.
        blocks = g.block_table.reshape(-1)
        k = k_cache.view(-1, bs, Hkv, D).index_select(0, blocks).view(B, -1, Hkv, D).transpose(1, 2)
        v = v_cache.view(-1, bs, Hkv, D).index_select(0, blocks).view(B, -1, Hkv, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling)
        o = o.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D)
        out[g.q_index.reshape(-1)[g.valid]] = o[g.valid]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
