"""Tool calls in a model's output: the `auto` parsers per model family (TOOL_CALL_PARSERS) and the
constrained modes (`required`, a named function), whole or streaming.

Every streamer's output, however the text is split into deltas, reassembles to what the whole
parse returns (see deployments/tool_json.py for the one exception: calls that break after their
name was sent).
"""

from __future__ import annotations

import json
from typing import List, Optional, Tuple

from deployments.tool_calls import FunctionCall, NamedToolChoice, ToolCall, ToolCallDelta, as_tool_choice
from deployments.tool_json import (
    CallStream,
    ContentOut,
    ParsedToolOutput,
    StreamPiece,
    call_from_object,
    content_or_none,
    holdback,
    skip_ws,
    tool_call,
    value_end,
)

_ARGUMENTS = ("arguments",)


def _parse_sequence(
    text: str, i: int, open_ch: Optional[str], sep: str, close_ch: Optional[str], arg_keys: Tuple[str, ...]
) -> Optional[List[Tuple[str, str]]]:
    """Call objects laid out as [open] obj (sep obj)* [close]; None unless all of text is that."""
    calls: List[Tuple[str, str]] = []
    if open_ch:
        i = skip_ws(text, i)
        if i >= len(text) or text[i] != open_ch:
            return None
        i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text) and calls and close_ch is None:  # a trailing separator
            return calls
        if i >= len(text) or text[i] != "{":
            return None
        j = value_end(text, i)
        call = None if j is None else call_from_object(text[i:j], arg_keys)
        if call is None:
            return None
        calls.append(call)
        i = skip_ws(text, j)
        if i >= len(text):
            return calls if close_ch is None else None
        if text[i] == sep:
            i += 1
        elif close_ch and text[i] == close_ch:
            return calls if skip_ws(text, i + 1) == len(text) else None
        else:
            return None


class _SequenceStream:
    """Streams the calls of _parse_sequence's layout."""

    def __init__(
        self, open_ch: Optional[str], sep: str, close_ch: Optional[str], arg_keys: Tuple[str, ...], pos: int = 0
    ):
        self.open_ch, self.sep, self.close_ch, self.arg_keys = open_ch, sep, close_ch, arg_keys
        self.text, self.pos, self.obj_start = "", pos, 0
        self.phase = "open" if open_ch else "object"
        self.calls: List[CallStream] = []

    def sent_any(self) -> bool:
        return any(c.sent_name for c in self.calls)

    def ok(self) -> bool:
        if self.close_ch:
            return self.phase == "done"
        return bool(self.calls) and self.phase in ("after", "object")

    def feed(self, delta: str) -> List[ToolCallDelta]:
        self.text += delta
        out: List[ToolCallDelta] = []
        while self.phase not in ("done", "failed"):
            if self.phase == "in_object":
                call, body = self.calls[-1], self.text[self.obj_start :]
                out += call.progress(body)
                if call.scan.failed:
                    self.phase = "failed"
                elif call.scan.end is not None:
                    deltas, valid = call.complete(body[: call.scan.end])
                    out += deltas
                    self.pos, self.phase = self.obj_start + call.scan.end, "after" if valid else "failed"
                    continue
                break
            i = skip_ws(self.text, self.pos)
            if i >= len(self.text):
                break
            c, self.pos = self.text[i], i + 1
            if self.phase == "open":
                self.phase = "object" if c == self.open_ch else "failed"
            elif self.phase == "object":
                if c != "{":
                    self.phase = "failed"
                    break
                self.calls.append(CallStream(len(self.calls), self.arg_keys))
                self.obj_start, self.phase = i, "in_object"
            elif c == self.sep:
                self.phase = "object"
            else:
                self.phase = "done" if self.close_ch and c == self.close_ch else "failed"
        return out


class HermesToolParser:
    """Hermes / Qwen2.5 / Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number,
    with text around them. Content is the text outside the tags; a malformed call stays content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedToolOutput:
        content, calls, i = [], [], 0
        while True:
            start = text.find(self.OPEN, i)
            end = -1 if start < 0 else text.find(self.CLOSE, start + len(self.OPEN))
            if end < 0:
                content.append(text[i:])
                return ParsedToolOutput(content_or_none("".join(content)), calls)
            content.append(text[i:start])
            call = call_from_object(text[start + len(self.OPEN) : end], _ARGUMENTS)
            if call is None:
                content.append(text[start : end + len(self.CLOSE)])
            else:
                calls.append(tool_call(call))
            i = end + len(self.CLOSE)

    def streamer(self) -> "HermesStreamer":
        return HermesStreamer()


class HermesStreamer:
    def __init__(self):
        self.pending, self.count, self.content = "", 0, ContentOut()
        self.call: Optional[CallStream] = None

    def feed(self, delta: str) -> StreamPiece:
        open_tag, close_tag = HermesToolParser.OPEN, HermesToolParser.CLOSE
        self.pending += delta
        piece = StreamPiece()
        while True:
            if self.call is None:
                start = self.pending.find(open_tag)
                if start < 0:  # hold back what could still become the tag
                    cut = len(self.pending) - holdback(self.pending, open_tag)
                    piece.content += self.content(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return piece
                piece.content += self.content(self.pending[:start])
                self.pending = self.pending[start + len(open_tag) :]
                self.call = CallStream(self.count, _ARGUMENTS)
                continue
            end = self.pending.find(close_tag)
            if end < 0:
                piece.tool_calls += self.call.progress(self.pending)
                return piece
            body = self.pending[:end]
            deltas, valid = self.call.complete(body)
            piece.tool_calls += deltas
            if valid or self.call.sent_name:
                self.count += 1
            else:
                piece.content += self.content(open_tag + body + close_tag)
            self.pending, self.call = self.pending[end + len(close_tag) :], None

    def finish(self) -> StreamPiece:
        rest = self.pending if self.call is None else HermesToolParser.OPEN + self.pending
        unsent = self.call is None or not self.call.sent_name
        self.pending, self.call = "", None
        return StreamPiece(self.content(rest) if unsent else "")


class Llama3JsonToolParser:
    """Llama 3.1/3.2 JSON tool calling: the output is (after optional <|python_tag|>) one or more
    {"name": ..., "parameters": {...}} objects separated by ";". Anything else is content, whole."""

    TAG = "<|python_tag|>"
    ARG_KEYS = ("parameters", "arguments")

    def start(self, text: str) -> Optional[int]:
        """Where the calls start, -1 when text is content, None when it cannot tell yet."""
        head = text.lstrip(" \t\n\r")
        at = len(text) - len(head)
        if head.startswith(self.TAG):
            return at + len(self.TAG)
        if head.startswith("{"):
            return at
        return None if self.TAG.startswith(head) else -1

    def parse(self, text: str) -> ParsedToolOutput:
        start = self.start(text)
        known = start is not None and start >= 0
        calls = _parse_sequence(text, start, None, ";", None, self.ARG_KEYS) if known else None
        if not calls:
            return ParsedToolOutput(content_or_none(text), [])
        return ParsedToolOutput(None, [tool_call(c) for c in calls])

    def streamer(self) -> "Llama3JsonStreamer":
        return Llama3JsonStreamer(self)


class Llama3JsonStreamer:
    def __init__(self, parser: Llama3JsonToolParser):
        self.parser, self.text, self.content = parser, "", ContentOut()
        self.calls: Optional[_SequenceStream] = None
        self.is_content = False

    def feed(self, delta: str) -> StreamPiece:
        if self.is_content:
            return StreamPiece(self.content(delta))
        if self.calls is not None:
            self.text += delta
            return StreamPiece(tool_calls=self.calls.feed(delta))
        self.text += delta
        start = self.parser.start(self.text)
        if start is None:
            return StreamPiece()
        if start < 0:
            self.is_content = True
            return StreamPiece(self.content(self.text))
        self.calls = _SequenceStream(None, ";", None, self.parser.ARG_KEYS, pos=start)
        return StreamPiece(tool_calls=self.calls.feed(self.text))

    def finish(self) -> StreamPiece:
        if self.is_content or (self.calls is not None and (self.calls.ok() or self.calls.sent_any())):
            return StreamPiece()
        return StreamPiece(self.content(self.text))  # not calls after all: all of it is content


TOOL_CALL_PARSERS = {"hermes": HermesToolParser(), "llama3_json": Llama3JsonToolParser()}


def calls_from_constrained(text: str, tool_choice) -> List[ToolCall]:
    """The calls in output constrained by constraint_schema: named -> text is the arguments object
    (kept as the model wrote it), required -> a JSON array of calls. ValueError when it is not."""
    tool_choice = as_tool_choice(tool_choice)
    if isinstance(tool_choice, NamedToolChoice):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"constrained output is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("constrained output is not a JSON object")
        return [ToolCall(function=FunctionCall(name=tool_choice.function.name, arguments=text))]
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
    calls = _parse_sequence(text, 0, "[", ",", "]", _ARGUMENTS)
    if not calls:
        raise ValueError("constrained output is not a JSON array of tool calls")
    return [tool_call(c) for c in calls]


class ConstrainedStreamer:
    """Streams calls_from_constrained's calls: a named call's arguments are every delta as it comes."""

    def __init__(self, tool_choice):
        tool_choice = as_tool_choice(tool_choice)
        self.name = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
        if self.name is None and tool_choice != "required":
            raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
        self.named = CallStream(0, _ARGUMENTS)
        self.calls = _SequenceStream("[", ",", "]", _ARGUMENTS)
        self.text = ""

    def feed(self, delta: str) -> StreamPiece:
        self.text += delta
        if self.name is None:
            return StreamPiece(tool_calls=self.calls.feed(delta))
        if not self.named.sent_name:
            self.named.sent_name = True
            return StreamPiece(tool_calls=[self.named.delta(delta, self.name)])
        return StreamPiece(tool_calls=[self.named.delta(delta)] if delta else [])

    def finish(self) -> StreamPiece:
        if self.name is None and not self.calls.ok() and not self.calls.sent_any():
            return StreamPiece(self.text)  # as the caller of calls_from_constrained returns it
        return StreamPiece()


def constrained_streamer(tool_choice) -> ConstrainedStreamer:
    return ConstrainedStreamer(tool_choice)
