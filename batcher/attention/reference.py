"""The oracle: gather each sequence's blocks, build a dense causal mask, run SDPA.

Slow (it copies every sequence's K/V history and syncs to read the lengths) but plainly right; every
other implementation is tested against it. Decode rows (one query) and prefill rows form separate
groups, so a long prompt chunk does not pad every decode row to its length.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Stores this step's K/V rows (T, Hkv, D) in their cache slots."""
    k_cache.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def reference_paged_attention(
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
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    out = query.new_zeros(query.shape)  # padding rows stay zero
    starts = query_start.tolist()
    ctx = context_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(ctx))]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    prefill = [b for b, n in enumerate(q_lens) if n > 1]
    for seqs in (decode, prefill):
        if seqs:
            _attend_group(out, query, k_cache, v_cache, seqs, starts, q_lens, ctx, block_tables, block_size, scale)
    return out


def _attend_group(
    out, query, k_cache, v_cache, seqs: List[int], starts, q_lens, ctx, block_tables, block_size: int, scale: float
) -> None:
    T, H, D = query.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    dev = query.device
    B, Q = len(seqs), max(q_lens[b] for b in seqs)
    num_blocks = max(-(-ctx[b] // block_size) for b in seqs)
    L = num_blocks * block_size
    ar_q = torch.arange(Q, device=dev)
    q_len = torch.tensor([q_lens[b] for b in seqs], device=dev)
    valid = ar_q[None, :] < q_len[:, None]  # (B, Q)
    q_index = torch.where(valid, torch.tensor([starts[b] for b in seqs], device=dev)[:, None] + ar_q, 0)
    # Absolute position of each query; padded ones see only key 0 (no empty softmax rows).
    first = torch.tensor([ctx[b] - q_lens[b] for b in seqs], device=dev)
    q_pos = torch.where(valid, first[:, None] + ar_q, 0)
    mask = torch.arange(L, device=dev)[None, None, :] <= q_pos[:, :, None]  # (B, Q, L)
    mask = mask[:, None, None].expand(B, 1, G, Q, L).reshape(B, 1, G * Q, L)
    table = block_tables[torch.tensor(seqs, device=dev), :num_blocks].long()
    # Query heads sharing a KV head go side by side, so K/V never need repeating (GQA).
    q = query[q_index].view(B, Q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Q, D)
    # index_select copies whole blocks; advanced indexing (cache[table]) is 2-3x slower on CPU.
    blocks = table.reshape(-1)
    k = k_cache.view(-1, block_size, Hkv, D).index_select(0, blocks).view(B, L, Hkv, D).transpose(1, 2)
    v = v_cache.view(-1, block_size, Hkv, D).index_select(0, blocks).view(B, L, Hkv, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=scale)
    o = o.view(B, Hkv, G, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H, D)
    flat_valid = valid.reshape(-1)
    out[q_index.reshape(-1)[flat_valid]] = o[flat_valid].to(out.dtype)
