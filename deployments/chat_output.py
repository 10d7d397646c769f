"""Generated text -> the OpenAI chat answer: plain content, or the tool calls in it.

`required` and named tool choices were constrained to JSON (deployments.tool_calls.constraint_schema)
and are read back as such; `auto` is read by the configured parser for the model family
(deployments.tool_parsers). Streams give the same calls as whole answers: arguments arrive in pieces,
as OpenAI's do.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

from deployments.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    StreamUsage,
)
from deployments.protocol import GenerateChunk, GeneratedChoice
from deployments.tool_calls import NamedToolChoice, effective_tool_choice
from deployments.tool_json import StreamPiece
from deployments.tool_parsers import TOOL_CALL_PARSERS, calls_from_constrained, constrained_streamer


def sse(obj) -> str:
    """One server-sent event of an OpenAI chunk."""
    return f"data: {obj.model_dump_json(exclude_none=True)}\n\n"


class ChatOutput:
    """How one chat request's text becomes its answer."""

    def __init__(self, body: ChatCompletionRequest, parser: str):
        self.choice = effective_tool_choice(body.tools, body.tool_choice) if body.tools else "none"
        self.constrained = self.choice == "required" or isinstance(self.choice, NamedToolChoice)
        self.parser = TOOL_CALL_PARSERS[parser]

    def message(self, out: GeneratedChoice) -> Tuple[ChatMessageOut, Optional[str]]:
        """The message and finish_reason of a whole answer."""
        if self.choice == "none":
            return ChatMessageOut(content=out.text), out.finish_reason
        if self.constrained:
            try:
                calls, content = calls_from_constrained(out.text, self.choice), None
            except ValueError:  # cut short by max_tokens: the text as it is
                return ChatMessageOut(content=out.text), out.finish_reason
        else:
            parsed = self.parser.parse(out.text)
            calls, content = parsed.tool_calls, parsed.content
        if not calls:
            return ChatMessageOut(content=out.text), out.finish_reason
        return ChatMessageOut(content=content, tool_calls=calls), _finish(out.finish_reason, True)

    def choice_of(self, out: GeneratedChoice) -> ChatChoice:
        message, finish = self.message(out)
        return ChatChoice(
            index=out.index,
            message=message,
            finish_reason=finish,
            logprobs=ChatLogprobs.of(out.logprobs) if out.logprobs is not None else None,
        )

    def streamer(self):
        """Per choice: feed(text) / finish() -> StreamPiece, or None for plain content."""
        if self.choice == "none":
            return None
        return constrained_streamer(self.choice) if self.constrained else self.parser.streamer()


def chat_events(body: ChatCompletionRequest, output: ChatOutput, make: Callable[..., ChatCompletionChunk]):
    """GenerateChunk -> the SSE text of its chat chunks. `make(choices, usage=None)` builds a chunk."""
    usage = StreamUsage(body.n)
    streamers: Dict[int, object] = {}
    called: Dict[int, bool] = {}  # choices that have streamed a tool call

    def events(chunk: GenerateChunk) -> str:
        out = ""
        if chunk.index not in streamers:  # each choice opens with the role, as OpenAI's do
            streamers[chunk.index] = output.streamer()
            out += sse(make([ChatChunkChoice(index=chunk.index, delta=ChatDelta(role="assistant", content=""))]))
        streamer = streamers[chunk.index]
        if streamer is None:
            piece = StreamPiece(chunk.text)
        else:
            piece = streamer.feed(chunk.text)
            if chunk.finish_reason is not None:
                rest = streamer.finish()
                piece = StreamPiece(piece.content + rest.content, piece.tool_calls + rest.tool_calls)
        called[chunk.index] = called.get(chunk.index, False) or bool(piece.tool_calls)
        if piece.content or piece.tool_calls or chunk.finish_reason or chunk.token_ids:
            delta = ChatDelta(
                content=piece.content if piece.content or not piece.tool_calls else None,
                tool_calls=piece.tool_calls or None,
            )
            lps = ChatLogprobs.of(chunk.logprobs) if chunk.logprobs else None
            out += sse(
                make(
                    [
                        ChatChunkChoice(
                            index=chunk.index,
                            delta=delta,
                            logprobs=lps,
                            finish_reason=_finish(chunk.finish_reason, called[chunk.index]),
                        )
                    ]
                )
            )
        total = usage.add(chunk)
        if total is not None and body.include_usage:
            out += sse(make([], total))
        return out

    return events


def _finish(reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI ends an answer that called tools with "tool_calls" (a cut-short one stays "length")."""
    return "tool_calls" if called and reason == "stop" else reason
