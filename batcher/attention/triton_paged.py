"""The CUDA implementation: a Triton kernel that reads K/V in place through the block tables.

`auto`'s choice on CUDA: run on an H100 (greedy float32 tokens equal HF's, eager and under CUDA graphs;
docs/forward.md), and tested on CPU under TRITON_INTERPRET=1.

Grid: (T // BLOCK_Q + B, Hkv), a bound known from shapes alone. Program p finds its sequence by binary
search over query_start (sequence b's tiles start at query_start[b] // BLOCK_Q + b), so no lengths are
read on the host: no sync, and the launch is the same for every step of a bucket (CUDA-graph safe).
Each program takes BLOCK_Q query rows of one sequence times the G query heads of one KV head
(GQA: K/V are loaded once for G heads) and loops over key tiles up to its last row's position.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # query vectors (rows x heads) per program; tl.dot needs >= 16
BLOCK_N = 32  # keys per tile


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_ptr,
    context_lens_ptr,
    block_tables_ptr,
    num_seqs,
    stride_bt,
    block_size,
    scale,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_ch,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Binary search: the last sequence whose first tile index is <= pid.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_ptr + seq)
    q_end = tl.load(query_start_ptr + seq + 1)
    row0 = q_start + (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if seq < num_seqs and row0 < q_end:
        ctx = tl.load(context_lens_ptr + seq)
        first_pos = ctx - (q_end - q_start)
        offs_m = tl.arange(0, BLOCK_M)
        row = row0 + offs_m // G
        head = kv_head * G + offs_m % G
        row_ok = (offs_m < BLOCK_Q * G) & (row < q_end)
        pos = tl.where(row_ok, first_pos + row - q_start, -1)  # absolute position of each query
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        n_keys = first_pos + tl.minimum(row0 + BLOCK_Q, q_end) - q_start
        table = block_tables_ptr + seq * stride_bt  # the eager runner's table is a column slice
        for start in range(0, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_keys
            block = tl.load(table + offs_n // block_size, mask=n_ok, other=0)
            slot = block.to(tl.int64) * block_size + offs_n % block_size
            kv_off = slot[:, None] * stride_ct + kv_head * stride_ch + offs_d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            if DOT_F32:  # exact fp32 products (no TF32), and bf16 under the interpreter
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on masked-out rows
        tl.store(
            out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def triton_paged_attention(
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
    k_cache.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
    query = query.contiguous()
    T, H, D = query.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    if G > BLOCK_M:
        raise ValueError(f"the Triton kernel takes at most {BLOCK_M} query heads per KV head, not {G}")
    block_q = BLOCK_M // G
    num_seqs = context_lens.shape[0]
    out = torch.zeros_like(query)  # padding rows stay zero
    grid = (T // block_q + num_seqs, Hkv)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        query_start,
        context_lens,
        block_tables,
        num_seqs,
        block_tables.stride(0),
        block_size,
        scale,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        G=G,
        BLOCK_Q=block_q,
        HEAD_DIM=D,
        D_PAD=max(16, triton.next_power_of_2(D)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        # Triton's interpreter (3.9) returns garbage from tl.dot on bf16 operands: upcast there.
        DOT_F32=query.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
    )
    return out
