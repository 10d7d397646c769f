"""Per-request sampling settings, validated at the edge."""

from __future__ import annotations

from typing import Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batcher.structured_outputs import StructuredOutputs

SEED_RANGE = (-(2**63), 2**64)
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 bans a token, +100 all but forces it
MAX_N = 128  # OpenAI's and vLLM's ceiling on `n`; the ingress's own limit (ingress.limits.max_n) is lower


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    n: int = Field(
        1,
        ge=1,
        le=MAX_N,
        description="Choices to generate from the one prompt (prefilled once, "
        "then forked); with `seed`, choice i samples with a seed derived from it (choice 0: `seed`).",
    )
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
    # Logits processing (batcher.sampler applies it, before temperature, top-k, top-p and greedy argmax).
    presence_penalty: float = Field(
        0.0,
        ge=PENALTY_RANGE[0],
        le=PENALTY_RANGE[1],
        allow_inf_nan=False,
        description="Subtracted once from the logit of every token already in the output (OpenAI's).",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=PENALTY_RANGE[0],
        le=PENALTY_RANGE[1],
        allow_inf_nan=False,
        description="Subtracted from a token's logit once per time it is in the output (OpenAI's).",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Tokens of the prompt or output: positive logits divided "
        "by it, negative ones multiplied (HF's and vLLM's); 1 = off, > 1 discourages repeats.",
    )
    logit_bias: Dict[int, float] = Field(
        default_factory=dict,
        description="Token id -> added to its logit, in [-100, 100] (OpenAI's; string "
        "keys as JSON sends them are converted).",
    )
    min_tokens: int = Field(
        0, ge=0, description="EOS and stop_token_ids cannot be sampled before this many tokens (vLLM's)."
    )
    structured_outputs: Optional[StructuredOutputs] = Field(
        None,
        description="The output must match this JSON schema, regex, choice or grammar (vLLM's field; "
        "batcher.grammar enforces it token by token).",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Union[None, str, List[str]]) -> List[str]:
        return stop_list(v)

    @field_validator("seed")
    @classmethod
    def _seed_fits_a_generator(cls, v: Optional[int]) -> Optional[int]:
        return check_seed(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, v: Dict[int, float]) -> Dict[int, float]:
        return check_logit_bias(v)

    @model_validator(mode="after")
    def _constraint_can_end(self):
        check_constraint_can_end(self.structured_outputs, self.ignore_eos)
        return self

    @model_validator(mode="after")
    def _min_tokens_fit(self):
        check_min_tokens(self.min_tokens, self.max_tokens)
        return self

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens applies: the sampler leaves other rows untouched."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# The checks, as functions: deployments.protocol.GenerateRequest, which declares the user-facing
# fields itself, runs the same ones with the same messages.


def stop_list(v: Union[None, str, List[str]]) -> List[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if any(not s for s in v):
        raise ValueError("stop strings must not be empty")
    return list(v)


def check_seed(v: Optional[int]) -> Optional[int]:
    # torch.Generator.manual_seed takes [-2**63, 2**64); past that the engine would crash mid-step
    if v is not None and not SEED_RANGE[0] <= v < SEED_RANGE[1]:
        raise ValueError(f"must be a 64-bit integer in [{SEED_RANGE[0]}, {SEED_RANGE[1] - 1}]")
    return v


def check_logit_bias(v: Dict[int, float]) -> Dict[int, float]:
    lo, hi = LOGIT_BIAS_RANGE
    bad = next((t for t, b in v.items() if not lo <= b <= hi), None)  # NaN fails the comparison too
    if bad is not None:
        raise ValueError(f"the bias of token {bad} is {v[bad]}, not a number in [{lo:g}, {hi:g}]")
    return v


def check_constraint_can_end(structured_outputs: Optional[StructuredOutputs], ignore_eos: bool) -> None:
    if structured_outputs is not None and ignore_eos:
        raise ValueError("ignore_eos: a structured output ends with EOS when its grammar is complete")


def check_min_tokens(min_tokens: int, max_tokens: Optional[int]) -> None:
    """`max_tokens` None (a GenerateRequest's: the rest of the context) is checked once it is resolved."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens: {min_tokens} is more than max_tokens {max_tokens}")
