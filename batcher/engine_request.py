"""A request's engine-side state beyond what the scheduler sees: its n choices, each a sequence with
its detokenizer, its logprobs and what of it was handed out in deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from batcher.detokenizer import IncrementalDetokenizer
from batcher.outputs import StreamDelta, TokenLogprob
from batcher.sequence import Sequence


@dataclass(eq=False)
class EngineChoice:
    """One of a request's n outputs."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: Optional[List[TokenLogprob]]
    num_sent: int = 0  # output tokens already handed out in deltas

    def delta(self) -> StreamDelta:
        """What this choice gained since its previous delta."""
        seq = self.seq
        new = seq.output_token_ids[self.num_sent :]
        logprobs = self.logprobs[self.num_sent :] if self.logprobs is not None else None
        self.num_sent = seq.num_output_tokens
        return StreamDelta(
            request_id=seq.request_id,
            token_ids=new,
            text=self.detokenizer.take(seq.is_finished),
            finish_reason=seq.finish_reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            index=seq.index,
        )


@dataclass(eq=False)
class EngineRequest:
    """Choice 0 prefills the prompt; the step that computes it forks the other n - 1
    (Scheduler.fork), which share its blocks."""

    choices: List[EngineChoice]
    grammar: Optional[object] = None  # the compiled grammar of a structured output (batcher.grammar)
    adapter: Optional[object] = None  # the LoRAAdapter it runs with (batcher.lora_adapter); None: the base

    @property
    def seq(self) -> Sequence:
        """Choice 0's sequence: the request's id, prompt and params."""
        return self.choices[0].seq

    @property
    def finished(self) -> bool:
        return len(self.choices) == self.seq.params.n and all(c.seq.is_finished for c in self.choices)

    def unforked_deltas(self, reason: str) -> List[StreamDelta]:
        """Final deltas of the choices never forked (the request ended before its prompt was computed)."""
        seq = self.seq
        return [
            StreamDelta(
                seq.request_id,
                [],
                "",
                reason,
                None if seq.params.logprobs is None else [],
                seq.num_prompt_tokens,
                0,
                seq.num_cached_tokens,
                index=i,
            )
            for i in range(len(self.choices), seq.params.n)
        ]
