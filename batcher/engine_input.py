"""EngineInput: one request as the engine takes it, from the replica (or an offline caller) down to
RequestBuilder.build, which checks and tokenizes it into an EngineRequest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from batcher.sampling_params import SamplingParams

Prompt = Union[str, List[int]]  # text (the engine tokenizes it) or token ids


@dataclass(frozen=True)
class EngineInput:
    """`request_id`: None gets a fresh one. `cache_salt`: requests share prefix-cache blocks only with
    requests of the same salt. `lora_name`: the LoRA adapter to run with (None: the base model), loaded
    from `lora_path` if it is not in memory (None: where the engine's LoRA config says)."""

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    lora_name: Optional[str] = None
    lora_path: Optional[str] = None
