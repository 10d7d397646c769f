"""Incremental detokenization and stop-string handling for one request."""

from __future__ import annotations

from typing import List, Optional


class IncrementalDetokenizer:
    """Decodes generated tokens a few at a time, holding back text that may still change
    (an incomplete UTF-8 character) or may turn out to be the start of a stop string."""

    def __init__(self, tokenizer, stop: List[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (stop string cut off once found)
        self._emitted = 0  # chars of text already handed out
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, output_ids: List[int]) -> Optional[str]:
        """Decodes the new tail of output_ids; returns the stop string if one appeared."""
        decode = self.tokenizer.decode
        prefix = decode(output_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(output_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # wait for the rest of a multi-byte character
        start = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(output_ids)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, max(0, start - len(s) + 1))) != -1]
        if not hits:
            return None
        at, s = min(hits)  # the earliest stop string wins
        self.text = self.text[:at]
        return s

    def take(self, final: bool) -> str:
        """Text not handed out yet; short of the end it keeps back a possible stop-string prefix."""
        end = len(self.text) if final or not self.stop else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
