"""The paged-attention op (`torch.ops.iterserve.paged_attention`) and its implementations."""

from batcher.attention.op import BACKENDS, paged_attention, resolve_backend

__all__ = ["BACKENDS", "paged_attention", "resolve_backend"]
