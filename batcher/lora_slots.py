"""Which adapter sits in which of the batch's `max_loras` weight slots, by its cache id (name and
weights digest: an adapter reloaded with other weights takes a slot of its own): bookkeeping only (the
scheduler's), the weights are copied by the engine (LoRAModel.load_slot) for the slots `take_loads`
names. A slot is held while a running sequence uses its adapter; an unheld slot keeps its adapter
(a later request reuses it for free) until another adapter needs the room, least recently used first.
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Tuple


class LoRASlots:
    def __init__(self, num_slots: int):
        self.names: List[Optional[str]] = [None] * num_slots
        self.holders = [0] * num_slots  # running sequences using each slot
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._loads: List[Tuple[int, str]] = []

    def slot_of(self, name: Optional[str]) -> int:
        """The slot holding `name`; -1 for the base model (None) or an adapter not in a slot."""
        return self.names.index(name) if name is not None and name in self.names else -1

    def can_acquire(self, name: Optional[str]) -> bool:
        return name is None or name in self.names or 0 in self.holders

    def acquire(self, name: Optional[str]) -> None:
        """Holds a slot for one more running sequence of `name` (can_acquire must be true)."""
        if name is None:
            return
        slot = self.slot_of(name)
        if slot < 0:  # the least recently used unheld slot (empty ones first)
            slot = min((i for i, h in enumerate(self.holders) if h == 0), key=lambda i: self._last_used[i])
            self.names[slot] = name
            self._loads.append((slot, name))
        self.holders[slot] += 1
        self._last_used[slot] = next(self._clock)

    def release(self, name: Optional[str]) -> None:
        slot = self.slot_of(name)
        if slot >= 0:
            self.holders[slot] -= 1

    def take_loads(self) -> List[Tuple[int, str]]:
        """(slot, adapter) pairs assigned since the last call, whose weights must be copied in."""
        loads, self._loads = self._loads, []
        return loads
