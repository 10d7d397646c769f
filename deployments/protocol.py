"""Typed request and responses of the LLM deployment: what other Ray jobs pass through a handle.

handle = serve.get_app_handle("iterserve")
resp: GenerateResponse = handle.generate.remote(GenerateRequest(prompt="Hi", max_tokens=8)).result()
for chunk in handle.options(stream=True).stream.remote(GenerateRequest(...)): ...  # GenerateChunk
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batcher.engine_input import EngineInput
from batcher.sampling_params import (
    MAX_N,
    PENALTY_RANGE,
    SamplingParams,
    check_constraint_can_end,
    check_logit_bias,
    check_min_tokens,
    check_seed,
    stop_list,
)
from batcher.structured_outputs import StructuredOutputs
from deployments.tool_calls import ToolChoice, ToolDefinition, check_tool_choice, constraint_schema


class ContentPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send name, tool_calls...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class GenerateRequest(BaseModel):
    """A prompt (text or token ids) or chat messages, and how to sample the answer: what callers send
    to the ingress (HTTP bodies become one too). The ingress turns it into a PreparedRequest, its
    sampling fields into the engine's SamplingParams (`sampling_params`), with the same ranges and
    checks (batcher.sampling_params' functions).

    `max_tokens=None` means: up to the end of the model's context window.
    """

    model_config = ConfigDict(extra="forbid")

    # The sampling fields come first: pydantic reports field errors in this order, and a 400 names the
    # first (deployments.errors.validation_error).
    max_tokens: Optional[int] = Field(None, ge=1, description="None: fill the rest of the context.")
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
    prompt: Union[str, List[int], None] = None
    messages: Optional[List[ChatMessage]] = None
    request_id: Optional[str] = None
    cache_salt: Optional[str] = Field(
        None,
        min_length=1,
        description="Requests share prefix-cache blocks only with requests of the same "
        "salt (as vLLM's cache_salt): tenants that must not learn of each other's prompts through cache "
        "timing each send their own.",
    )
    tools: Optional[List[ToolDefinition]] = Field(
        None,
        description="Functions the model may call (chat only): the chat template renders them; "
        "deployments.tool_parsers reads calls back out of the text.",
    )
    tool_choice: Optional[ToolChoice] = Field(
        None,
        description="'none', 'auto' (default with tools), 'required' or a named function: the last two "
        "constrain the output to the functions' JSON schemas (deployments.tool_calls.constraint_schema).",
    )
    parallel_tool_calls: bool = True
    model: Optional[str] = Field(
        None,
        description="The served model's name (None: it), a LoRA adapter's name, or `base:adapter` "
        "(Ray Serve LLM's form); deployments.adapters.AdapterRegistry resolves it.",
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

    # The sampling checks first, in SamplingParams' order, then the request's own: the first that fails
    # is the 400.
    @model_validator(mode="after")
    def _constraint_can_end(self) -> "GenerateRequest":
        check_constraint_can_end(self.structured_outputs, self.ignore_eos)
        return self

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> "GenerateRequest":
        check_min_tokens(self.min_tokens, self.max_tokens)
        return self

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("pass exactly one of `prompt` and `messages`")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must not be empty")
        if self.tools and self.messages is None:
            raise ValueError("tools: only chat requests (`messages`) can call tools")
        check_tool_choice(self.tools, self.tool_choice)
        if self.structured_outputs is not None and self.tool_constraint() is not None:
            raise ValueError(
                "tool_choice: a required or named tool choice constrains the output already; "
                "drop response_format / structured_outputs"
            )
        return self

    def tool_constraint(self) -> Optional[StructuredOutputs]:
        schema = constraint_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        return StructuredOutputs(json=schema) if schema is not None else None

    @property
    def prompt_param(self) -> str:
        """The request field that holds the input (errors about the prompt name it)."""
        return "messages" if self.messages is not None else "prompt"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams, `max_tokens` resolved (the ingress's: None becomes the rest of
        the context) and a tool choice's constraint in structured_outputs."""
        return SamplingParams(
            max_tokens=max_tokens,
            structured_outputs=self.structured_outputs or self.tool_constraint(),
            **self.model_dump(include=set(PASSED_SAMPLING_FIELDS)),
        )


# The fields GenerateRequest and SamplingParams both declare pass as they are; max_tokens and
# structured_outputs are resolved first (GenerateRequest.sampling_params).
PASSED_SAMPLING_FIELDS = frozenset(GenerateRequest.model_fields) & frozenset(SamplingParams.model_fields) - {
    "max_tokens",
    "structured_outputs",
}


@dataclass(frozen=True)
class PreparedRequest:
    """What LLM replicas accept, made once per request by the ingress (deployments.prompts.prepare):
    the prompt with the chat template applied, as token ids, and max_tokens resolved. The request
    router reads `prompt_token_ids`, `max_tokens`, `request_id`, `cache_salt` and `lora_name` from it.
    `lora_name`: the LoRA adapter (None: the base model); `lora_path`: where the ingress knows it is, so
    whichever replica gets the request can load it (None: the replica's own config finds it)."""

    request_id: str
    prompt_token_ids: List[int]
    params: SamplingParams
    cache_salt: Optional[str] = None
    prompt_param: str = "prompt"  # "prompt" | "messages": where the client put the input
    lora_name: Optional[str] = None
    lora_path: Optional[str] = None

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def engine_input(self) -> EngineInput:
        """What the replica's engine takes (AsyncLLMEngine.stream)."""
        return EngineInput(
            self.prompt_token_ids, self.params, self.request_id, self.cache_salt, self.lora_name, self.lora_path
        )


class TopLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float


class OutputLogprob(BaseModel):
    """The sampled token's logprob and its top alternatives, as callers receive them."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class GeneratedChoice(BaseModel):
    """One of a request's n outputs (GenerateRequest.n)."""

    index: int = 0
    text: str
    token_ids: List[int]
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    logprobs: Optional[List[OutputLogprob]] = None
    completion_tokens: int = 0


class _GenerateOutput(GeneratedChoice):
    request_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the replica's prefix cache supplied
    replica_id: Optional[str] = None  # the LLM replica that served it (HTTP: header X-Iterserve-Replica)
    # Seconds from the LLM replica receiving the request to its first token: set on a stream's first
    # chunk and on whole answers (HTTP: the Server-Timing header's replica-ttft).
    replica_ttft_s: Optional[float] = None


class GenerateChunk(_GenerateOutput):
    """New tokens of choice `index` since its previous chunk; finish_reason is set on its last chunk
    (with n > 1 the choices' chunks interleave, and the stream ends after every choice's last)."""

    # Wall-clock time (time.time()) the LLM replica sent a stream's first chunk: the ingress times
    # the chunk's way back with it (HTTP: the Server-Timing header's from-replica).
    replica_sent_at: Optional[float] = None


class GenerateResponse(_GenerateOutput):
    """A whole, non-streamed answer. Its own text, token_ids, finish_reason and logprobs are choice
    0's; with n > 1, `choices` holds all n, by index. completion_tokens counts every choice's tokens
    and prompt_tokens the prompt once (OpenAI's usage)."""

    choices: List[GeneratedChoice] = Field(default_factory=list)  # n > 1 only


class ModelInfo(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    model_name: str
    max_model_len: int
    simulation: Optional[str] = None  # set on simulated replicas: what they simulate
    replica_id: Optional[str] = None
    loras: List[str] = Field(default_factory=list)  # adapters this replica knows (configured or in memory)
    lora_config: Optional[dict] = None  # the engine's `lora` section (None: no adapters)
