"""The OpenAI HTTP API's request and response bodies (the subset iterserve serves).

Unknown request fields are refused with a 400, as OpenAI itself does. Penalties and logit_bias are
OpenAI's, as are response_format (a JSON object or schema); repetition_penalty, min_tokens, top_k,
ignore_eos, cache_salt and structured_outputs (json, regex, choice, grammar) are extensions (vLLM's
names). Their ranges are GenerateRequest's, checked when the body becomes one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batcher.structured_outputs import StructuredOutputs
from deployments.protocol import ChatMessage, GenerateRequest, OutputLogprob
from deployments.tool_calls import ToolCall, ToolCallDelta, ToolChoice, ToolDefinition


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    json_schema: Optional[Dict[str, Any]] = Field(None, alias="schema")  # OpenAI: absent means any object
    strict: Optional[bool] = None  # the output always follows the schema here: strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self

    def constraint(self) -> Optional[StructuredOutputs]:
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema.json_schema is None):
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=self.json_schema.json_schema)
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    # JSON's NaN and Infinity tokens (Python's json accepts them) are refused, naming the field.
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # extension
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # extension
    n: int = 1  # choices; 1..ingress.limits.max_n (deployments/limits.py)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, float]] = None  # token id (a string, as JSON keys are) -> bias
    repetition_penalty: Optional[float] = None  # extension
    min_tokens: Optional[int] = None  # extension
    user: Optional[str] = None
    cache_salt: Optional[str] = Field(None, min_length=1)  # extension (vLLM's): see GenerateRequest
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None  # extension (vLLM's): json, regex, choice, grammar

    def _generate_fields(self) -> dict:
        names = (
            "model",
            "n",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "cache_salt",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "repetition_penalty",
            "min_tokens",
        )
        fields = {k: getattr(self, k) for k in names} | {"structured_outputs": self._constraint()}
        return {k: v for k, v in fields.items() if v is not None} | {"ignore_eos": self.ignore_eos}

    def _constraint(self) -> Optional[StructuredOutputs]:
        from_format = self.response_format.constraint() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs: give one constraint, not both")
        return from_format or self.structured_outputs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Request):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = None  # "none", "auto" (default with tools), "required", a function
    parallel_tool_calls: bool = True

    def to_generate(self, request_id: str) -> GenerateRequest:
        top = (self.top_logprobs or 0) if self.logprobs else None
        return GenerateRequest(
            messages=self.messages,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            logprobs=top,
            request_id=request_id,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            **self._generate_fields(),
        )


class CompletionRequest(_Request):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.echo or self.suffix or (self.best_of or 1) != 1:
            raise ValueError("echo, suffix and best_of are not supported")
        return self

    def to_generate(self, request_id: str) -> GenerateRequest:
        return GenerateRequest(
            prompt=self.prompt,
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            request_id=request_id,
            **self._generate_fields(),
        )


# ---- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails  # as OpenAI reports what its prompt cache saved

    @classmethod
    def of(cls, out) -> "Usage":
        """From a GenerateResponse, or the last GenerateChunk of a stream."""
        return cls(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            total_tokens=out.prompt_tokens + out.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_tokens),
        )


class StreamUsage:
    """A stream's usage, known once all n choices have finished: the prompt once, every choice's
    completion tokens (OpenAI's; sent in one chunk before [DONE] when include_usage)."""

    def __init__(self, n: int):
        self.open, self.tokens = set(range(n)), {}

    def add(self, chunk) -> Optional[Usage]:
        """Counts a GenerateChunk; the usage when it was the last choice's last chunk, else None."""
        self.tokens[chunk.index] = chunk.completion_tokens
        if chunk.finish_reason is None:
            return None
        self.open.discard(chunk.index)
        if self.open:
            return None
        return Usage.of(chunk.model_copy(update={"completion_tokens": sum(self.tokens.values())}))


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: List[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: List[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: List[ChatTokenLogprob]

    @classmethod
    def of(cls, lps: List[OutputLogprob]) -> "ChatLogprobs":
        def top(t) -> ChatTopLogprob:
            return ChatTopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))

        return cls(
            content=[
                ChatTokenLogprob(**top(lp).model_dump(), top_logprobs=[top(t) for t in lp.top_logprobs]) for lp in lps
            ]
        )


class CompletionLogprobs(BaseModel):
    tokens: List[str]
    token_logprobs: List[float]
    top_logprobs: List[Dict[str, float]]
    text_offset: List[int]

    @classmethod
    def of(cls, lps: List[OutputLogprob], start_offset: int = 0) -> "CompletionLogprobs":
        offsets, pos = [], start_offset
        for lp in lps:
            offsets.append(pos)
            pos += len(lp.token)
        return cls(
            tokens=[lp.token for lp in lps],
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{t.token: t.logprob for t in lp.top_logprobs} for lp in lps],
            text_offset=offsets,
        )


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]  # None when the answer is tool calls only, as OpenAI's
    tool_calls: Optional[List[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCallDelta]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None  # None only on stream chunks


class ModelCard(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "iterserve"
    root: Optional[str] = None  # vLLM's: the base model's name for the base, the adapter's for an adapter
    parent: Optional[str] = None  # a LoRA adapter's base model (None: the base itself)
    max_model_len: Optional[int] = None
    simulation: Optional[str] = None  # present only on simulated replicas: never a real model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]
