"""Iteration-level scheduler: decides every step which sequences run and how many tokens each computes.

Continuous mode (vLLM v1 style): one token budget per step, spent on running sequences first
(decode-first keeps inter-token latency steady), then on admitting waiting ones; a prompt larger
than what is left of the budget is split across steps (chunked prefill). When the KV cache runs out,
the most recently admitted sequence is preempted by recompute and nothing new is admitted that step.
Static mode: a batch of `static_batch_size` is admitted only when the previous one has fully ended.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional, Set, Tuple

from batcher.block_manager import BlockManager
from batcher.lora_slots import LoRASlots
from batcher.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    samples: bool = field(init=False)  # this step reaches the last token, so its logits give a new one

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: List[ScheduledSeq] = field(default_factory=list)
    preempted: List[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.0,
        static_batch_size: Optional[int] = None,
        lora_slots: Optional[LoRASlots] = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.static_batch_size = static_batch_size  # None: continuous
        self.lora_slots = lora_slots  # None: no adapters; else a sequence runs only with its adapter in a slot
        self.waiting: Deque[Sequence] = deque()
        self.running: List[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self._static_batch: Set[Sequence] = set()  # static mode: the current batch's unfinished sequences
        self._batch_open = False  # static mode: the current batch still takes new members

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.grow(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        static = self.static_batch_size is not None
        if static and not self._static_batch:
            self._batch_open = True
        limit = self.static_batch_size if static else self.max_num_seqs
        bm = self.block_manager
        skipped: List[Sequence] = []  # their adapter found no free slot: later ones may still run
        stays_open = False
        while self.waiting and len(self.running) < limit:
            if budget <= 0:
                stays_open = True  # a static batch stays open: the budget, not the queue, stopped it
                break
            seq = self.waiting[0]
            if static and not self._batch_open and seq not in self._static_batch:
                break  # only the running batch's preempted members may come back
            if self.lora_slots is not None and not self.lora_slots.can_acquire(seq.lora_id):
                skipped.append(self.waiting.popleft())
                continue
            cached = bm.match_prefix(seq)
            n = min(seq.num_tokens - len(cached) * bm.block_size, budget)
            if not bm.can_admit(cached, n, self.watermark_blocks):
                break
            self.waiting.popleft()
            bm.admit(seq, cached)
            bm.grow(seq, n)
            self._run(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))  # back in their places, ahead of the rest
        if not stays_open:
            self._batch_open = False

    def _run(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if self.lora_slots is not None:
            self.lora_slots.acquire(seq.lora_id)
        if self.static_batch_size is not None:
            self._static_batch.add(seq)

    def fork(self, parent: Sequence, children: List[Sequence]) -> List[Tuple[int, int]]:
        """Adds `parent`'s new choices (Sequence.fork) after its prompt was computed (update_after_step):
        each shares its blocks while there is a seat in the batch and a block for the partial last
        one; the others wait at the head of the queue, older than anything there, and come back
        through the prefix cache like preempted sequences. Returns the (source, copy) block pairs
        whose K/V the caller must copy."""
        copies: List[Tuple[int, int]] = []
        limit = self.static_batch_size if self.static_batch_size is not None else self.max_num_seqs
        queued = []
        for child in children:
            if len(self.running) >= limit or not self.block_manager.can_fork(parent):
                queued.append(child)
                continue
            pair = self.block_manager.fork(parent, child)
            if pair is not None:
                copies.append(pair)
            self._run(child)  # the parent holds its adapter's slot: the child shares it
        for child in reversed(queued):
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)
            if self.static_batch_size is not None:
                self._static_batch.add(child)  # part of the running batch: it may come back to it
        return copies

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, go back to the head of the queue."""
        self.block_manager.free(seq)
        if self.lora_slots is not None:
            self.lora_slots.release(seq.lora_id)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Marks the scheduled tokens computed (call before appending sampled tokens)."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Takes `seq` out of the batch (finished, stopped or aborted) and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if self.lora_slots is not None:
                self.lora_slots.release(seq.lora_id)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._static_batch.discard(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def kv_slot_use(self) -> float:
        """Share of allocated KV slots that hold a computed token."""
        used = self.block_manager.used_slots()
        return min(1.0, sum(s.num_computed_tokens for s in self.running) / used) if used else 1.0
