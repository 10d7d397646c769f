"""Typed request and responses of the LLM deployment: what other Ray jobs pass through a handle.

handle = serve.get_app_handle("iterserve")
resp: GenerateResponse = handle.generate.remote(GenerateRequest(prompt="Hi", max_tokens=8)).result()
for chunk in handle.options(stream=True).stream.remote(GenerateRequest(...)): ...  # GenerateChunk
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batcher.sampling_params import SamplingParams
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


class GenerateRequest(SamplingParams):
    """A prompt (text or token ids) or chat messages, plus SamplingParams' fields: what callers send
    to the ingress (HTTP bodies become one too). The ingress turns it into a PreparedRequest.

    `max_tokens=None` means: up to the end of the model's context window.
    """

    prompt: Union[str, List[int], None] = None
    messages: Optional[List[ChatMessage]] = None
    max_tokens: Optional[int] = Field(None, ge=1, description="None: fill the rest of the context.")
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
        fields = set(SamplingParams.model_fields) - {"max_tokens", "structured_outputs"}
        return SamplingParams(
            max_tokens=max_tokens,
            structured_outputs=self.structured_outputs or self.tool_constraint(),
            **self.model_dump(include=fields),
        )


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
    """One of a request's n outputs (SamplingParams.n)."""

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
