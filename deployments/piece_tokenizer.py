"""Prompts tokenized a piece at a time, each piece's ids remembered: a chat's history is tokenized once.

A chat client resends the whole conversation every turn, so the ingress tokenized every earlier
turn again on each one: a third of its CPU in the routing benchmark's busy chats (py-spy; ~14 ms for
a 3,700-token turn on a Zen 3 core), beside the routers' decisions and the streams it relays.

A fast tokenizer (HF `tokenizers`) cuts its input at its added tokens (`<|im_start|>`, `<|im_end|>`)
before anything else, normalizes and encodes each piece between them on its own, then wraps the
whole in its post-processor's tokens (a BOS). So a prompt's ids are the wrapper's, its added tokens'
and its pieces' ids in order, and a piece seen before (the system prompt, each earlier message) costs
a dictionary lookup. That holds when no added token strips the whitespace beside it or matches only
whole words, none is matched after a normalizer, and no pre-tokenizer treats the text's first piece
apart from the others (Metaspace's `prepend_scheme: first`, SentencePiece-style tokenizers). Where
it does not hold, or a probe of every added token does not come out exactly as the tokenizer's own
call, every text is tokenized whole, as before.
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections import OrderedDict
from typing import List, Optional, Tuple

logger = logging.getLogger("iterserve.prompts")

MAX_CACHED_CHARS = 8_000_000  # ~8 MB of text and 4 bytes a token of ids, per ingress replica
MIN_CACHED_CHARS = 64  # shorter pieces cost less to encode than to remember


class PieceTokenizer:
    """`encode(text)`: the ids `tokenizer(text)["input_ids"]` gives, from the pieces between added
    tokens, each remembered (an LRU bounded by `max_chars` of text). Not thread-safe: one per
    preparing thread."""

    def __init__(self, tokenizer, max_chars: int = MAX_CACHED_CHARS):
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._pieces: "OrderedDict[str, array]" = OrderedDict()
        self._chars = 0
        self.hits = self.misses = 0
        self._split: Optional[Tuple[re.Pattern, dict, List[int], List[int]]] = None
        why = self._setup()
        if why:
            logger.info("prompts are tokenized whole: %s", why)

    def encode(self, text: str) -> List[int]:
        if self._split is None:
            return self.tokenizer(text)["input_ids"]
        pattern, added_ids, head, tail = self._split
        parts = pattern.split(text)  # odd items: the added tokens it cut at
        known = [None if i % 2 else self._known(p) for i, p in enumerate(parts)]
        todo = [i for i in range(0, len(parts), 2) if known[i] is None]
        # One call for every piece not remembered: it lets other threads run (Tokenizer.encode does not).
        for i, encoding in zip(todo, self._backend.encode_batch([parts[i] for i in todo], add_special_tokens=False)):
            known[i] = self._remember(parts[i], encoding.ids)
        ids = list(head)
        for i, piece in enumerate(parts):
            if i % 2:
                ids.append(added_ids[piece])
            else:
                ids.extend(known[i])
        ids.extend(tail)
        return ids

    @property
    def whole(self) -> bool:
        """True where every text is tokenized whole (the pieces would not give the same ids)."""
        return self._split is None

    def _cacheable(self, piece: str) -> bool:
        return MIN_CACHED_CHARS <= len(piece) <= self.max_chars // 8

    def _known(self, piece: str):
        if not piece:
            return ()
        ids = self._pieces.get(piece) if self._cacheable(piece) else None
        if ids is not None:
            self.hits += 1
            self._pieces.move_to_end(piece)
        return ids

    def _remember(self, piece: str, ids: List[int]):
        if not self._cacheable(piece) or piece in self._pieces:  # twice in one text: counted once
            return ids
        self.misses += 1
        self._pieces[piece] = packed = array("i", ids)
        self._chars += len(piece)
        while self._chars > self.max_chars:
            old, _ = self._pieces.popitem(last=False)
            self._chars -= len(old)
        return packed

    def _setup(self) -> Optional[str]:
        """Splits at the added tokens where that gives the tokenizer's own ids; else why not."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return "not a fast tokenizer"
        self._backend = backend
        if getattr(backend, "encode_special_tokens", False):
            return "added tokens are encoded as text"
        spec = json.loads(backend.to_str())
        if (spec.get("model") or {}).get("dropout"):
            return "BPE dropout"
        if _first_piece_apart(spec.get("pre_tokenizer")):
            return "the pre-tokenizer treats the first piece apart"
        added = {}
        for tid, t in backend.get_added_tokens_decoder().items():
            if t.lstrip or t.rstrip or t.single_word or (t.normalized and spec.get("normalizer")):
                return f"added token {t.content!r} is not cut exactly"
            added[t.content] = tid
        if not added:
            return "no added tokens to cut at"
        # The post-processor's wrapper (a BOS, an EOS), read off a probe's ids with and without it.
        probe = backend.encode("x", add_special_tokens=False).ids
        wrapped = backend.encode("x", add_special_tokens=True).ids
        at = _find(wrapped, probe)
        if at < 0:
            return "the post-processor changes the text's own ids"
        head, tail = wrapped[:at], wrapped[at + len(probe) :]
        alternatives = "|".join(re.escape(c) for c in sorted(added, key=len, reverse=True))
        self._split = (re.compile(f"({alternatives})"), added, head, tail)
        probe_text = _probe(list(added))
        same = self.encode(probe_text) == self.tokenizer(probe_text)["input_ids"]
        self._pieces.clear()
        self._chars = self.hits = self.misses = 0
        if not same:
            self._split = None
            return "a probe's ids differ from the tokenizer's"
        return None


def _first_piece_apart(pre_tokenizer) -> bool:
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme", "always") == "first":
        return True
    return any(_first_piece_apart(p) for p in pre_tokenizer.get("pretokenizers") or [])


def _find(seq: List[int], sub: List[int]) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    return -1


def _probe(added: List[str]) -> str:
    """Text around every added token: spaces, newlines, words and symbols on either side, twice in
    a row, and a long piece (cached) before and after."""
    long = "The quick brown fox, naïve café — 数字 42\n\n  jumps.\t" * 3
    parts = [long]
    for c in added:
        parts += [f" {c} a", f"\n{c}\nb ", f"{c}{c}", f"x{c}y", f"  {c}", f"{c}  "]
    return "".join(parts) + long
