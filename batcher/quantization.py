"""Weight-only int8 linear layers (`engine.quantization: int8`).

Each linear layer's weight is stored as int8 with one scale per output channel (symmetric, absmax /
127); activations stay in the model's dtype (bf16 or fp16). Reading half of bf16's bytes is the point
on a memory-bound CPU. On CPUs with AVX512_BF16 the C++ kernel of batcher/native/linear.cpp runs
products of up to 32 rows (`batcher.cpu_linear.use_kernel_linears`), and a tied lm_head reads the input embedding's bf16
weight (in memory anyway), keeping the head's precision. Elsewhere, products of a few rows (decode
steps) run torch's own `aten._weight_int8pack_mm` (CPU and CUDA; torch.compile keeps it as one call),
which is no GEMM: from ~16 rows on it is 2-4x slower than a bf16 GEMM (measured here on SmolLM2's
shapes). Bigger products use the GEMM, on the int8 weights converted to the activation dtype (exact:
int8 values are bf16 values) with the scale applied to the output, or on a tied head's embedding.
Numbers and quality cost: docs/forward.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("int8",)
# Rows up to which the int8 kernel beats the GEMM path (1 thread, bf16): 8 for the decoder's
# projections; 4 for a tied lm_head, whose alternative reads the bf16 embedding without converting.
PACKED_MAX_ROWS = 8
PACKED_MAX_ROWS_TIED = 4


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype):
    """Per-output-channel symmetric int8: returns (int8 weight, scales in `dtype`). The scale is
    rounded to `dtype` before the weight is divided by it, so int8 * scale is the nearest grid point
    to each weight (no per-channel gain error from rounding the scale afterwards)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(dtype).tiny).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


class Int8WeightLinear(torch.nn.Module):
    """y = x @ (q * scale)^T + bias, with q int8 (out, in) and scale (out,) in the activation dtype.
    `tied_embedding`: a module whose float `.weight` is the same matrix (the input embedding of a tied
    lm_head), used for products of more than `max_packed_rows` rows."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: Optional[torch.Tensor],
        tied_embedding: Optional[torch.nn.Module] = None,
    ):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(scales.dtype), requires_grad=False)
        # In a tuple, not a submodule: the embedding stays the model's, converted and saved once.
        self._tied = (tied_embedding,) if tied_embedding is not None else ()
        self.max_packed_rows = PACKED_MAX_ROWS_TIED if self._tied else PACKED_MAX_ROWS
        self.cpu_kernel = False  # set by batcher.cpu_linear.use_kernel_linears where the C++ kernel runs

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Linear, dtype: torch.dtype, tied_embedding: Optional[torch.nn.Module] = None
    ) -> "Int8WeightLinear":
        qweight, scales = quantize_int8(linear.weight, dtype)
        return cls(qweight, scales, linear.bias, tied_embedding)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernel:  # one opaque op each; products they do not take go to F.linear inside
            if self._tied:  # the embedding is read in bf16 anyway: the head keeps its precision
                return torch.ops.iterserve_cpu.linear(x, self._tied[0].weight, self.bias)
            return torch.ops.iterserve_cpu.linear_int8(x, self.qweight, self.scales, self.bias)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.max_packed_rows:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        elif self._tied:
            y = F.linear(rows, self._tied[0].weight)
        else:
            y = F.linear(rows, self.qweight.to(rows.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        tied = ", tied to the input embedding" if self._tied else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only{tied}"


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replaces every linear layer of `model` (nn.Linear or any subclass) with Int8WeightLinear,
    scales in `dtype`; returns how many. An lm_head tied to the input embedding keeps the embedding
    as its float weight for big products. Call on float32 weights for the most faithful int8 values."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear)
    ]
    for parent, name, child in targets:
        tied = embedding if embedding is not None and child.weight is embedding.weight else None
        setattr(parent, name, Int8WeightLinear.from_linear(child, dtype, tied))
    return len(targets)
