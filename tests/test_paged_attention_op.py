"""Every paged-attention implementation against the gather + SDPA reference (batcher/attention/)."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batcher.attention import paged_attention, resolve_backend

BLOCK = 4


def make_step(q_lens, ctx_lens, heads, kv_heads, head_dim=32, dtype=torch.float32, pad=0, extra_seqs=0, seed=0):
    """Random caches and one step's metadata: sequence b has q_lens[b] new tokens ending at ctx_lens[b]
    (q_len < ctx_len: a prefix already cached), blocks scattered in the cache, the last block scratch.
    `pad` padding rows and `extra_seqs` unused trailing sequences (q_len 0, context 0) as the runner's
    fixed-size buffers have."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // BLOCK) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks - 1, generator=g).tolist()  # never the scratch (last) block
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    width = max(blocks_needed) + 1  # one column of 0 padding
    rows = tables + [[] for _ in range(extra_seqs)]
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32)
    scratch = (num_blocks - 1) * BLOCK
    slots = [
        t[p // BLOCK] * BLOCK + p % BLOCK for t, n, c in zip(tables, q_lens, ctx_lens) for p in range(c - n, c)
    ] + [scratch] * pad
    T = len(slots)
    starts = [0]
    for n in list(q_lens) + [0] * extra_seqs:
        starts.append(starts[-1] + n)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(
        query=rand(T, heads, head_dim),
        key=rand(T, kv_heads, head_dim),
        value=rand(T, kv_heads, head_dim),
        k_cache=rand(num_blocks * BLOCK, kv_heads, head_dim),
        v_cache=rand(num_blocks * BLOCK, kv_heads, head_dim),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor(list(ctx_lens) + [0] * extra_seqs, dtype=torch.int32),
        block_tables=block_tables,
        block_size=BLOCK,
        scale=head_dim**-0.5,
    )


def with_sliced_table(step):
    """The same step with its block table a column slice of a wider buffer, as the eager runner passes
    it (`block_tables[:B, :width]`): rows `stride(0)` apart, not `width`. The buffer's other columns
    hold other blocks, so a kernel stepping rows by the width reads the wrong blocks."""
    table = step["block_tables"]
    wide = torch.randint(
        0,
        step["k_cache"].shape[0] // BLOCK,
        (table.shape[0], table.shape[1] + 7),
        dtype=table.dtype,
        generator=torch.Generator().manual_seed(1),
    )
    wide[:, : table.shape[1]] = table
    sliced = wide[:, : table.shape[1]]
    assert not sliced.is_contiguous()
    return {**step, "block_tables": sliced}


def run(backend, step):
    args = {k: (v.clone() if k in ("k_cache", "v_cache") else v) for k, v in step.items()}
    out = paged_attention(**args, backend=backend)
    return out, args["k_cache"], args["v_cache"]


def naive(step):
    """Attention written out per query row from the definition, after writing K/V."""
    k_cache, v_cache = step["k_cache"].clone().float(), step["v_cache"].clone().float()
    k_cache[step["slot_mapping"]] = step["key"].float()
    v_cache[step["slot_mapping"]] = step["value"].float()
    q = step["query"].float()
    out = torch.zeros_like(q)
    starts, ctx = step["query_start"].tolist(), step["context_lens"].tolist()
    G = q.shape[1] // k_cache.shape[1]
    for b in range(len(ctx)):
        n = starts[b + 1] - starts[b]
        for i in range(n):
            pos = ctx[b] - n + i
            slots = [int(step["block_tables"][b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(pos + 1)]
            k = k_cache[slots].repeat_interleave(G, dim=1)  # (L, H, D)
            v = v_cache[slots].repeat_interleave(G, dim=1)
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[starts[b] + i], k) * step["scale"], dim=-1)
            out[starts[b] + i] = torch.einsum("hl,lhd->hd", w, v)
    return out, k_cache, v_cache


CASES = {  # name: (q_lens, ctx_lens, heads, kv_heads, pad, extra_seqs)
    "decode batch, ragged, GQA 3": ([1, 1, 1, 1], [1, 7, 8, 29], 6, 2, 0, 0),
    "prefill chunks after prefix hits, GQA 4": ([5, 12], [9, 12], 8, 2, 0, 0),
    "mixed decode + prefill, padding rows, MHA": ([1, 6, 1, 3], [13, 6, 4, 21], 4, 4, 5, 0),
    "unused trailing sequences, GQA 1": ([2, 1], [2, 17], 3, 3, 2, 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_the_definition(case):
    q_lens, ctx, H, Hkv, pad, extra = CASES[case]
    step = make_step(q_lens, ctx, H, Hkv, pad=pad, extra_seqs=extra)
    out, k_cache, v_cache = run("reference", step)
    want, want_k, want_v = naive(step)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, want_k)  # cache writes landed in their slots, nothing else moved
    torch.testing.assert_close(v_cache, want_v)
    assert out[step["query_start"][-1] :].abs().sum() == 0  # padding rows are zero


def random_case(rng: random.Random):
    B = rng.randint(1, 6)
    kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 3, 4])
    q_lens, ctx = [], []
    for _ in range(B):
        n = 1 if rng.random() < 0.5 else rng.randint(2, 20)
        q_lens.append(n)
        ctx.append(n + (rng.randint(0, 30) if rng.random() < 0.6 else 0))  # prefix already cached
    return q_lens, ctx, kv_heads * group, kv_heads, rng.randint(0, 4), rng.randint(0, 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("seed", range(6))
def test_cpu_kernel_matches_reference(seed, dtype, tol):
    q_lens, ctx, H, Hkv, pad, extra = random_case(random.Random(seed))
    step = make_step(q_lens, ctx, H, Hkv, head_dim=64, dtype=dtype, pad=pad, extra_seqs=extra, seed=seed)
    want, want_k, want_v = run("reference", step)
    out, k_cache, v_cache = run("cpu", step)
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_block_table_sliced_from_a_wider_buffer_reads_its_own_rows(backend):
    step = make_step([1, 6, 1, 9], [11, 6, 30, 13], 6, 2, head_dim=48, pad=3, extra_seqs=1)
    want, _, _ = run("reference", step)
    out, _, _ = run(backend, with_sliced_table(step))
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def check_triton_against_reference():
    """Runs in a fresh interpreter whose TRITON_INTERPRET=1 was set before triton was first imported."""
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        step = make_step([1, 6, 1, 9], [11, 6, 30, 13], 6, 2, head_dim=48, dtype=dtype, pad=3, extra_seqs=1)
        want, want_k, want_v = run("reference", step)
        out, k_cache, v_cache = run("triton", step)
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
        # The eager runner's table is a column slice (found on an H100: eager Triton steps read every
        # sequence but the first through the wrong blocks).
        out, _, _ = run("triton", with_sliced_table(step))
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    print("triton matches")


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when triton's own functions are decorated, at its first import, which
    # torch.compile may already have done in this process: check in a subprocess.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parent)}
    code = "import test_paged_attention_op as t; t.check_triton_against_reference()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0 and "triton matches" in proc.stdout, proc.stderr[-3000:]


def test_compiled_call_sees_one_opaque_op():
    step = make_step([1, 4], [9, 4], 6, 2, pad=2)

    def attend(query, key, value, k_cache, v_cache, slot_mapping, query_start, context_lens, block_tables):
        out = torch.ops.iterserve.paged_attention(
            query * 1.0,
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            query_start,
            context_lens,
            block_tables,
            BLOCK,
            0.2,
            "reference",
        )
        return out.sum(-1)

    tensors = [
        step[k]
        for k in (
            "query",
            "key",
            "value",
            "k_cache",
            "v_cache",
            "slot_mapping",
            "query_start",
            "context_lens",
            "block_tables",
        )
    ]
    eager_args = [t.clone() for t in tensors]
    compiled_args = [t.clone() for t in tensors]
    want = attend(*eager_args)
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(*compiled_args)
    torch.testing.assert_close(got, want)
    assert torch.equal(compiled_args[3], eager_args[3])  # the mutation survives compilation


def test_auto_resolves_by_device_and_names_are_checked():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"  # run and matched on an H100
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("triton", torch.device("cpu"))
