"""The JSON pieces of tool calls, complete or partial: one call object -> (name, arguments), and
the deltas of a call as its text streams in. The parsers that find calls in an output are
deployments/tool_parsers.py.

Arguments keep the model's exact text (the raw JSON of its arguments object), so a call's
streamed fragments concatenate to the same string the non-streamed parse returns.
Streaming commits: once a call's name has been sent it cannot be taken back, so a call that turns
out malformed after that (e.g. cut by max_tokens) ends with the arguments sent so far, where the
non-streamed parse would return its text as content. Malformed calls caught before their name is
sent (not JSON, no name) stream as content, like the parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from deployments.tool_calls import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta, new_tool_call_id

_WS = " \t\n\r"


@dataclass
class ParsedToolOutput:
    content: Optional[str]
    tool_calls: List[ToolCall] = field(default_factory=list)


@dataclass
class StreamPiece:
    content: str = ""
    tool_calls: List[ToolCallDelta] = field(default_factory=list)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class _BracketScan:
    """Where a JSON string, object or array starting at `start` ends, scanning only new text."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False

    def advance(self, text: str) -> Optional[int]:
        for j in range(self.pos, len(text)):
            c = text[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.pos = j + 1
                        return j + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = j + 1
                    return j + 1
        self.pos = len(text)
        return None


def value_end(text: str, i: int) -> Optional[int]:
    """End of the JSON value starting at text[i], or None when text stops before it does.
    Only finds the extent; json.loads validates."""
    if text[i] in '"{[':
        return _BracketScan(i).advance(text)
    j = i  # a literal: runs to the next delimiter
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


@dataclass
class _CallScan:
    failed: bool = False
    name: Optional[str] = None  # only when "name" comes before the arguments
    args_start: Optional[int] = None
    args_end: Optional[int] = None
    end: Optional[int] = None  # end of the call object


def _scan_call(text: str, arg_keys: Tuple[str, ...]) -> _CallScan:
    """How far a (possibly partial) call object {"name": ..., "arguments": {...}} has come."""
    scan, n = _CallScan(), len(text)
    i = skip_ws(text, 0)
    if i == n:
        return scan
    if text[i] != "{":
        scan.failed = True
        return scan
    i, first = i + 1, True
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if not first:
            if text[i] != ",":
                scan.failed = True
                return scan
            i = skip_ws(text, i + 1)
            if i >= n:
                return scan
        if text[i] != '"':
            scan.failed = True
            return scan
        j = value_end(text, i)
        if j is None:
            return scan
        try:
            key = json.loads(text[i:j])
        except ValueError:
            scan.failed = True
            return scan
        i = skip_ws(text, j)
        if i >= n:
            return scan
        if text[i] != ":":
            scan.failed = True
            return scan
        i = skip_ws(text, i + 1)
        if i >= n:
            return scan
        is_args = key in arg_keys and scan.args_start is None
        if is_args:
            scan.args_start = i
        j = value_end(text, i)
        if j is None:
            return scan
        if is_args:
            scan.args_end = j
        elif key == "name" and scan.name is None and scan.args_start is None:
            try:
                value = json.loads(text[i:j])
            except ValueError:
                scan.failed = True
                return scan
            if isinstance(value, str):
                scan.name = value
        i, first = j, False


def call_from_object(text: str, arg_keys: Tuple[str, ...] = ("arguments",)) -> Optional[Tuple[str, str]]:
    """(name, arguments text) of a complete call object, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    scan = _scan_call(text, arg_keys)
    if not isinstance(obj, dict) or scan.failed or scan.end is None or not isinstance(obj.get("name"), str):
        return None
    name = scan.name if scan.name is not None else obj["name"]
    if scan.args_start is None:
        return name, "{}"
    raw = text[scan.args_start : scan.args_end]
    value = json.loads(raw)
    if isinstance(value, dict):
        return name, raw  # the model's own text: what streaming sends
    if isinstance(value, str):  # some models send the arguments JSON as a string
        return name, value
    return None


class CallStream:
    """One call's deltas: its name as soon as it is known, then its arguments' text as it comes."""

    def __init__(self, index: int, arg_keys: Tuple[str, ...]):
        self.index, self.arg_keys, self.id = index, arg_keys, new_tool_call_id()
        self.sent_name, self.sent_args = False, ""
        self.scan = _CallScan()
        self.args_tail: Optional[_BracketScan] = None
        self.args_tail_start = 0

    def delta(self, arguments: str, name: Optional[str] = None) -> ToolCallDelta:
        if name is None:
            return ToolCallDelta(index=self.index, function=FunctionCallDelta(arguments=arguments))
        return ToolCallDelta(
            index=self.index, id=self.id, type="function", function=FunctionCallDelta(name=name, arguments=arguments)
        )

    def progress(self, text: str) -> List[ToolCallDelta]:
        if self.args_tail is not None:  # inside the arguments object: scan only the new text
            if self.args_tail.advance(text) is None:
                return self._fragment(text[self.args_tail_start :])
            self.args_tail = None  # it closed: a full scan finds the end of the call
        self.scan = scan = _scan_call(text, self.arg_keys)
        # A complete object is left to complete(), which validates it before sending anything new.
        if scan.failed or scan.end is not None or (not self.sent_name and scan.name is None):
            return []
        arguments = ""
        if scan.args_start is not None and text[scan.args_start] == "{":
            arguments = text[scan.args_start : scan.args_end or len(text)]
            if scan.args_end is None:  # rescanning the call on every delta would be quadratic
                self.args_tail, self.args_tail_start = _BracketScan(scan.args_start), scan.args_start
                self.args_tail.advance(text)
        if not self.sent_name:
            self.sent_name, self.sent_args = True, arguments
            return [self.delta(arguments, scan.name)]
        return self._fragment(arguments)

    def _fragment(self, arguments: str) -> List[ToolCallDelta]:
        """The part of `arguments` (the text so far) not sent yet."""
        fragment = arguments[len(self.sent_args) :]
        self.sent_args = arguments
        return [self.delta(fragment)] if fragment else []

    def complete(self, text: str) -> Tuple[List[ToolCallDelta], bool]:
        """The last deltas of the finished call object `text`, and whether it is a valid call."""
        call = call_from_object(text, self.arg_keys)
        if call is None:
            return [], False
        name, arguments = call
        if not self.sent_name:
            self.sent_name, self.sent_args = True, arguments
            return [self.delta(arguments, name)], True
        rest = arguments[len(self.sent_args) :] if arguments.startswith(self.sent_args) else ""
        self.sent_args += rest
        return ([self.delta(rest)] if rest else []), True


class ContentOut:
    """Content as it comes, except whitespace-only content, which the parse returns as None."""

    def __init__(self):
        self.held, self.started = "", False

    def __call__(self, text: str) -> str:
        if self.started:
            return text
        self.held += text
        if not self.held.strip():
            return ""
        self.started, out, self.held = True, self.held, ""
        return out


def content_or_none(text: str) -> Optional[str]:
    return text if text.strip() else None


def tool_call(call: Tuple[str, str]) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call[0], arguments=call[1]))


def holdback(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
