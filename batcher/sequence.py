"""One request's state as the scheduler and block manager see it: no tensors, no model."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from batcher.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: List[int]
    params: SamplingParams
    token_ids: List[int] = field(default_factory=list)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V sit in the cache. Reset to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    block_table: List[int] = field(default_factory=list)
    # Parent of the first block's hash: the model and the request's cache salt (batcher.block_hash).
    cache_root: bytes = b""
    # Hashes of this sequence's full blocks, in order (prefix caching).
    block_hashes: List[bytes] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    index: int = 0  # which of the request's `params.n` choices this sequence generates
    # The LoRA adapter it runs with, as its cache id (name and weights digest: two versions of one
    # name are two adapters to the slots); None: the base model.
    lora_id: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, index: int) -> "Sequence":
        """Choice `index` of this sequence's request: the same tokens, no blocks yet (the scheduler
        gives it this sequence's blocks, or queues it), what the client is told was cached."""
        return Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            token_ids=list(self.token_ids),
            cache_root=self.cache_root,
            num_cached_tokens=self.num_cached_tokens,
            index=index,
            lora_id=self.lora_id,
        )
