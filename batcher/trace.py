"""Batch-occupancy trace: which batch slot held which sequence, doing what, at every step.

The seeds' picture (slots x iterations; prompt, generated, end-of-sequence and idle cells) drawn from
a real run. The engine has no fixed slots, so the trace assigns them: a sequence takes the lowest free
slot when it first runs and keeps it until it finishes, is preempted or aborted. Off by default
(`EngineConfig.trace_steps = 0`); when on, a step costs one small list, and recording stops after
`trace_steps` steps so memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence

IDLE, PROMPT, GENERATED, FINISHED = 0, 1, 2, 3
CELL_NAMES = {IDLE: "idle", PROMPT: "prompt", GENERATED: "generated", FINISHED: "finished"}


@dataclass
class StepTrace:
    cells: Dict[int, int]  # slot -> PROMPT / GENERATED / FINISHED (absent: idle)
    request_ids: Dict[int, str]  # slot -> request id
    waiting: int  # sequences left in the queue after this step


@dataclass
class OccupancyTrace:
    max_steps: int
    steps: List[StepTrace] = field(default_factory=list)
    _slot_of: Dict[str, int] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.max_steps

    def record(self, scheduled: Sequence, running_ids: set, waiting: int) -> None:
        """`scheduled`: this step's ScheduledSeq list, after the step (tokens computed and appended);
        `running_ids`: request ids still in the batch after it."""
        if self.full:
            return
        cells, ids = {}, {}
        for s in scheduled:
            seq = s.seq
            rid = seq.request_id
            if rid not in self._slot_of:
                used = set(self._slot_of.values())
                self._slot_of[rid] = next(i for i in range(len(used) + 1) if i not in used)
            slot = self._slot_of[rid]
            computed_before = seq.num_computed_tokens - s.num_new_tokens
            if seq.is_finished:
                cells[slot] = FINISHED
            elif s.num_new_tokens > 1 or computed_before < seq.num_prompt_tokens:
                cells[slot] = PROMPT
            else:
                cells[slot] = GENERATED
            ids[slot] = rid
        for rid in [r for r in self._slot_of if r not in running_ids]:
            del self._slot_of[rid]  # finished, preempted or aborted: the slot is free from the next step
        self.steps.append(StepTrace(cells, ids, waiting))

    @property
    def num_slots(self) -> int:
        return 1 + max((s for step in self.steps for s in step.cells), default=-1)

    def grid(self, num_slots: int = 0) -> List[List[int]]:
        """rows = slots, columns = steps; cell codes IDLE / PROMPT / GENERATED / FINISHED."""
        n = max(num_slots, self.num_slots)
        return [[step.cells.get(slot, IDLE) for step in self.steps] for slot in range(n)]

    def utilization(self, num_slots: int) -> float:
        """Share of slot-steps doing work (prompt, generated or finishing) out of num_slots x steps."""
        busy = sum(len(step.cells) for step in self.steps)
        return busy / (num_slots * len(self.steps)) if self.steps else 0.0

    def to_dict(self) -> dict:
        return {
            "cell_names": CELL_NAMES,
            "num_slots": self.num_slots,
            "steps": [{"cells": s.cells, "waiting": s.waiting} for s in self.steps],
        }
