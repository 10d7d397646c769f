"""Per-request sampling settings, validated at the edge."""
from __future__ import annotations

from typing import List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


SEED_RANGE = (-(2**63), 2**64)


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    seed: Optional[int] = Field(None, description="Per-request seed: same tokens whatever the batch.")
    stop: List[str] = Field(default_factory=list, description="Stop strings (not included in text).")
    stop_token_ids: List[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = Field(
        None, ge=0, le=20, description="Return the sampled token's logprob and this many top alternatives."
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Union[None, str, List[str]]) -> List[str]:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return list(v)

    @field_validator("seed")
    @classmethod
    def _seed_fits_a_generator(cls, v: Optional[int]) -> Optional[int]:
        # torch.Generator.manual_seed takes [-2**63, 2**64); past that the engine would crash mid-step
        if v is not None and not SEED_RANGE[0] <= v < SEED_RANGE[1]:
            raise ValueError(f"must be a 64-bit integer in [{SEED_RANGE[0]}, {SEED_RANGE[1] - 1}]")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
