"""The CPU implementation: a C++ kernel (paged_kernel.cpp) built once with -O3 -march=native and OpenMP
through torch.utils.cpp_extension, cached under torch's extensions directory (TORCH_EXTENSIONS_DIR):
~10 s of CPU to build cold, ~1 s to load warm.

It reads K/V through the block tables a 16-key tile at a time (no gathered history, no dense mask),
with an online softmax in float32 for fp32, bf16 and fp16 caches.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_kernel.cpp")


@functools.lru_cache(maxsize=None)
def build() -> None:
    """Compiles (or loads the cached build of) the kernel; resolve_backend calls it at start-up."""
    from torch.utils.cpp_extension import load

    # The name carries the source's hash, so an edited kernel never loads a stale build.
    digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
    load(name=f"iterserve_paged_attention_{digest}", sources=[str(SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


MAX_HEAD_DIM = 256  # the kernel's fixed buffers (paged_kernel.cpp: MAX_D, MAX_Q)
MAX_GROUP = 48


def cpu_paged_attention(query, key, value, k_cache, v_cache, slot_mapping, query_start, context_lens,
                        block_tables, block_size: int, scale: float) -> torch.Tensor:
    if query.shape[-1] > MAX_HEAD_DIM or query.shape[1] // k_cache.shape[1] > MAX_GROUP:
        from batcher.attention.reference import reference_paged_attention  # geometry it cannot hold

        return reference_paged_attention(query, key, value, k_cache, v_cache, slot_mapping, query_start,
                                         context_lens, block_tables, block_size, scale)
    build()
    return torch.ops.iterserve_cpu.paged_attention(query, key, value, k_cache, v_cache, slot_mapping,
                                                   query_start, context_lens, block_tables, block_size, scale)
