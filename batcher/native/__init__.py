"""The project's C++ CPU kernels, built once with -O3 -march=native and OpenMP through
torch.utils.cpp_extension and cached under torch's extensions directory (TORCH_EXTENSIONS_DIR):
~10-20 s of CPU to build cold, ~1 s to load warm. Each source registers its ops under
`torch.ops.iterserve_cpu`.
- paged_attention.cpp: the paged-attention op's CPU implementation (batcher/attention/cpu_kernel.py);
- linear.cpp: linear layers with bf16 or int8 weights for decode-sized batches (batcher/cpu_linear.py).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

HERE = Path(__file__).parent


@functools.lru_cache(maxsize=None)
def build(source: str) -> None:
    """Compiles (or loads the cached build of) HERE/source; raises when there is no compiler."""
    from torch.utils.cpp_extension import load

    path = HERE / source
    # The name carries the source's hash, so an edited kernel never loads a stale build.
    digest = hashlib.sha1(path.read_bytes()).hexdigest()[:10]
    load(name=f"iterserve_{path.stem}_{digest}", sources=[str(path)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
