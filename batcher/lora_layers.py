"""The batched LoRA product inside the model's linear layers: one forward serves a batch of mixed
adapters and base requests.

Every adaptable linear layer keeps `max_loras` weight slots side by side, A as (in, slots x rank) and
B as (slots x rank, out). A step gives each token its slot (-1: the base model), and each layer adds

    ((x @ A_all) * mask) @ B_all,   mask[t, j] = 1 where column j belongs to token t's slot

two dense products over the slots in use (Punica's shrink and expand, gathered by a mask instead of
a per-token gather), so there is no Python loop over adapters inside a layer and base tokens get
exactly zero added. Slots are filled by copying an adapter's weights in (load_slot), never allocated.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from batcher.lora_adapter import LoRAAdapter


class LoRAStep:
    """This step's token -> slot mask, shared by every LoRALinear (None: no token uses an adapter)."""

    def __init__(self):
        self.mask: Optional[torch.Tensor] = None  # (tokens, columns) in the model's dtype
        self.columns = 0  # slot columns in use this step: (highest slot in use + 1) x rank


class LoRALinear(torch.nn.Module):
    """A linear layer plus its adapters' slots. Its parameters stay those of `base`."""

    def __init__(self, base: torch.nn.Linear, step: LoRAStep, slots: int, rank: int):
        super().__init__()
        self.base, self.step, self.rank = base, step, rank
        w = base.weight
        self.register_buffer(
            "lora_a", torch.zeros(base.in_features, slots * rank, dtype=w.dtype, device=w.device), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(slots * rank, base.out_features, dtype=w.dtype, device=w.device), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask, cols = self.step.mask, self.step.columns
        if mask is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        h = torch.mm(flat, self.lora_a[:, :cols]) * mask
        return y + torch.mm(h, self.lora_b[:cols]).reshape(y.shape)

    def load(self, slot: int, weights: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes an adapter's (A, B) into `slot`, zero-padded to the slot's rank (None: zeros)."""
        cols = slice(slot * self.rank, (slot + 1) * self.rank)
        self.lora_a[:, cols] = 0
        self.lora_b[cols] = 0
        if weights is not None:
            a, b = weights
            r = a.shape[0]
            self.lora_a[:, cols.start : cols.start + r] = a.t().to(self.lora_a.dtype)
            self.lora_b[cols.start : cols.start + r] = b.t().to(self.lora_b.dtype)


class LoRAModel:
    """Wraps a model's adaptable linear layers in place and drives their slots."""

    def __init__(self, model: torch.nn.Module, modules: List[str], slots: int, rank: int):
        self.step = LoRAStep()
        self.slots, self.rank = slots, rank
        self.layers: Dict[str, LoRALinear] = {}
        for name in modules:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            wrapped = LoRALinear(getattr(parent, child), self.step, slots, rank)
            setattr(parent, child, wrapped)
            self.layers[name] = wrapped
        self._slot_of_column = torch.arange(slots * rank) // rank
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def load_slot(self, slot: int, adapter: Optional[LoRAAdapter]) -> None:
        for name, layer in self.layers.items():
            layer.load(slot, adapter.weights.get(name) if adapter is not None else None)

    def set_step(self, token_slots: Optional[List[int]], rows: int, compiled: bool) -> None:
        """Each token's slot (-1: base) for the next forward of `rows` rows (padding rows: base);
        None: no adapter this step, no LoRA work at all. Eager steps use the columns of the slots up to
        the highest in use; a compiled forward always sees every column (one graph, not one per width)."""
        if token_slots is None:
            self.step.mask, self.step.columns = None, 0
            return
        cols = self.slots * self.rank if compiled else (max(token_slots, default=-1) + 1) * self.rank
        slots = torch.full((rows,), -1)
        slots[: len(token_slots)] = torch.tensor(token_slots, dtype=torch.long)
        mask = (self._slot_of_column[None, :cols] == slots[:, None]).to(device=self._device, dtype=self._dtype)
        if compiled:
            torch._dynamo.mark_dynamic(mask, 0)  # as the step's other token-sized inputs
        self.step.mask, self.step.columns = mask, cols
