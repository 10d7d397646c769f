"""Faster linear layers on CPU at decode-sized batches, switched in place on a loaded model.

- bfloat16 and int8 weights (`use_kernel_linears`): the C++ kernel of batcher/native/linear.cpp,
  one opaque op each (`torch.ops.iterserve_cpu.linear`, `.linear_int8`, also inside the compiled
  forward) that handles up to 16 (int8: 32) rows itself and hands bigger products to `F.linear`.
  SmolLM2-135M's weights once through it: 9.7 ms for 1 row against oneDNN's 21.7-26.8 ms, 5.7 ms in
  int8 (2 threads, every projection and the lm_head; docs/forward.md).
- float32, eager (`use_weight_major_linears`): `F.linear` computes x @ W^T. On CPU (MKL, fp32) that
  path is slow when x has a few rows: with 4-64 rows a decoder's projections take 1.2-1.8x and its
  49152-wide lm_head up to 3.5x as long as the same product computed as (W @ x^T)^T, measured here
  over 30 layers' worth of weights (cold caches). From ~256 rows on, the two are equal. Results
  differ only in float rounding order, as they do between batch sizes; greedy parity with Hugging
  Face `generate` is tested (tests/test_engine_parity.py).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from batcher import native

logger = logging.getLogger(__name__)

# Rows up to which (W @ x^T)^T is used; one row stays on F.linear (MKL's GEMV is as fast).
MAX_ROWS = 256


class WeightMajorLinear(torch.nn.Linear):
    """nn.Linear whose product is W @ x^T for 2..MAX_ROWS rows of input. Same parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < 2 or rows > MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_weight_major_linears(model: torch.nn.Module) -> int:
    """Switches every nn.Linear of a CPU model to WeightMajorLinear in place (parameters, ties and
    hooks untouched); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = WeightMajorLinear
            count += 1
    return count


class BF16KernelLinear(torch.nn.Linear):
    """nn.Linear whose product is the C++ bf16 kernel's op (which falls back to F.linear itself for
    shapes it does not take). Same parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.iterserve_cpu.linear(x, self.weight, self.bias)


@functools.lru_cache(maxsize=None)
def linear_kernel_available() -> bool:
    """Builds (or loads) the kernel; False (logged once without a compiler) where it does not run."""
    try:
        native.build("linear.cpp")
    except Exception as e:  # no compiler: F.linear serves
        logger.warning("the bf16 linear kernel did not build (%s); using F.linear", e)
        return False
    torch.library.register_fake("iterserve_cpu::linear")(_fake_linear)
    torch.library.register_fake("iterserve_cpu::linear_int8")(_fake_linear_int8)
    return bool(torch.ops.iterserve_cpu.linear_has_kernel())


def _fake_linear(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_linear_int8(x, weight, scale, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def use_kernel_linears(model: torch.nn.Module) -> int:
    """Switches every plain bf16 nn.Linear of a CPU model to BF16KernelLinear in place, and every
    int8 layer (batcher/quantization.py) to the kernel's int8 op; returns how many (0 where the
    kernel is not available)."""
    from batcher.quantization import Int8WeightLinear

    if not linear_kernel_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
            module.__class__ = BF16KernelLinear
            count += 1
        elif (
            isinstance(module, Int8WeightLinear)
            and module.qweight.device.type == "cpu"
            and module.scales.dtype == torch.bfloat16
        ):
            module.cpu_kernel = True
            count += 1
    return count
