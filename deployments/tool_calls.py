"""OpenAI tool calling at the edges: request/response models, the JSON schema that constrains
`required` and named tool choices, and rendering tools and tool turns into the chat prompt.

Parsing a model's output into tool calls (auto, and the constrained modes) is deployments/tool_parsers.py.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(BaseModel):
    """One streamed piece of a call; dump with exclude_none=True so later pieces carry only
    index and function.arguments, as OpenAI's chunks do."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta


def as_tools(tools: Optional[Sequence[Union[ToolDefinition, dict]]]) -> List[ToolDefinition]:
    return [t if isinstance(t, ToolDefinition) else ToolDefinition.model_validate(t) for t in tools or []]


def as_tool_choice(tool_choice: Union[ToolChoice, dict, None]) -> Optional[ToolChoice]:
    return NamedToolChoice.model_validate(tool_choice) if isinstance(tool_choice, dict) else tool_choice


def effective_tool_choice(tools, tool_choice) -> ToolChoice:
    """OpenAI's default: "auto" when tools are given, "none" otherwise."""
    tool_choice = as_tool_choice(tool_choice)
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def check_tool_choice(tools, tool_choice) -> None:
    """Raises ValueError (a 400 for the caller) when tools and tool_choice do not fit together."""
    tools, tool_choice = as_tools(tools), as_tool_choice(tool_choice)
    names = [t.function.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"tools: duplicate function names {duplicates}")
    if tool_choice == "required" and not tools:
        raise ValueError('tool_choice "required" needs at least one tool in tools')
    if isinstance(tool_choice, NamedToolChoice):
        if not tools:
            raise ValueError(f"tool_choice names function {tool_choice.function.name!r} but no tools are given")
        if tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names function {tool_choice.function.name!r}, which is not in tools ({', '.join(names)})"
            )


def _parameters(function: FunctionDefinition) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object"}


def constraint_schema(tools, tool_choice, parallel_tool_calls: bool = True) -> Optional[dict]:
    """The JSON schema the output must follow, or None when the output is free text (auto, none).
    Named: the function's arguments object. Required: an array of {"name", "arguments"} calls."""
    tools, tool_choice = as_tools(tools), as_tool_choice(tool_choice)
    check_tool_choice(tools, tool_choice)
    if isinstance(tool_choice, NamedToolChoice):
        return _parameters(next(t.function for t in tools if t.function.name == tool_choice.function.name))
    if tool_choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "arguments": _parameters(t.function)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


# ---- the prompt ----------------------------------------------------------------------------------


def template_knows_tools(tokenizer) -> bool:
    source = tokenizer.chat_template or ""
    if isinstance(source, dict):  # named templates; transformers picks "tool_use" when tools are given
        source = " ".join(source.values())
    return "tools" in source


def _decoded_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:  # not ours to reject here: the template gets the text as sent
            return arguments
    return arguments


def _hf_message(message: dict) -> dict:
    """An OpenAI message as transformers' tool-aware templates expect it: arguments as dicts."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _decoded_arguments(c["function"].get("arguments"))}}
            for c in out["tool_calls"]
        ]
    return out


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. "
    "The functions' signatures are inside <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> XML tags, one per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>'
)


def _hermes_call_text(call: dict) -> str:
    body = {"name": call["function"]["name"], "arguments": _decoded_arguments(call["function"].get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _hermes_messages(messages: List[dict], tools: List[dict]) -> List[dict]:
    """Tools and tool turns as plain system/user/assistant text (the Hermes format), for templates
    that ignore tools: the model still sees them, and the hermes parser reads its answer."""
    out: List[dict] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_hermes_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_response"):  # consecutive results: one user turn, as Qwen does
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_response": True})
        else:
            out.append({**m, "content": content})
    out = [{k: v for k, v in m.items() if k != "tool_response"} for m in out]
    if tools:
        block = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(tokenizer, messages: List[dict], tools=None) -> str:
    """The prompt text for OpenAI-shaped messages and tools. A template that handles tools gets
    them as transformers expects; one that ignores them gets the Hermes format as text."""
    tool_dicts = [t.model_dump(exclude_none=True) for t in as_tools(tools)]
    if template_knows_tools(tokenizer):
        extra = {"tools": tool_dicts} if tool_dicts else {}
        return tokenizer.apply_chat_template(
            [_hf_message(m) for m in messages], tokenize=False, add_generation_prompt=True, **extra
        )
    return tokenizer.apply_chat_template(
        _hermes_messages(messages, tool_dicts), tokenize=False, add_generation_prompt=True
    )
