"""Grammar-constrained decoding with xgrammar (the default of vLLM and SGLang).

GrammarCache compiles a request's StructuredOutputs once per distinct constraint, on a pool thread
with a deadline (a schema that would stall the server is refused, not waited on). ConstrainedRows
holds one matcher per constrained sequence and fills the step's token masks on a worker thread
while the forward runs; rows without a constraint are never touched, so a batch without one pays
nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import torch

from batcher.errors import InvalidRequestError
from batcher.sequence import Sequence
from batcher.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# xgrammar's errors start with "[12:27:19] /project/cpp/json_schema_converter.cc:4944: ": keep the rest.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")
PARAM = "structured_outputs"  # the request field errors name (response_format and tools become it)


class GrammarCache:
    """Compiled grammars by constraint (LRU). Thread-safe: requests compile on their callers' threads."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        compile_timeout_s: float,
        max_entries: int = 256,
        max_compiling: int = 4,
    ):
        import xgrammar as xgr  # imported here: only engines that constrain pay its import

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._done: "OrderedDict[str, object]" = OrderedDict()
        self._pending: Dict[str, cf.Future] = {}  # a slow constraint sent again waits on the same compile
        self._lock = threading.Lock()
        self.compile_timeout_s = compile_timeout_s
        self.max_entries = max_entries
        self.max_compiling = max_compiling

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of `spec`; InvalidRequestError when it cannot compile or takes longer
        than compile_timeout_s (the compile goes on, and a later request gets its result)."""
        key = spec.cache_key()
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            future = self._pending.get(key)
            if future is None:
                if len(self._pending) >= self.max_compiling:  # stalled compiles must not pile up threads
                    raise InvalidRequestError(
                        f"structured output: {len(self._pending)} slow constraints are still "
                        "compiling on this replica; retry later or simplify the schema",
                        PARAM,
                    )
                future = self._pending[key] = cf.Future()
                # A daemon thread: a compile that never ends must not hold the replica's exit.
                threading.Thread(
                    target=self._run_compile, args=(key, spec, future), daemon=True, name="iterserve-grammar"
                ).start()
        try:
            return future.result(timeout=self.compile_timeout_s)
        except cf.TimeoutError:
            raise InvalidRequestError(
                f"structured output: compiling the {spec.kind} constraint took longer than "
                f"{self.compile_timeout_s:g} s, so it was refused (a simpler schema or grammar compiles faster)",
                PARAM,
            ) from None
        except Exception as e:  # xgrammar raises RuntimeError for bad schemas, regexes and grammars
            message = _LOCATION.sub("", str(e)).strip()
            raise InvalidRequestError(
                f"structured output: the {spec.kind} constraint is not supported: {message}", PARAM
            ) from None

    def _run_compile(self, key: str, spec: StructuredOutputs, future: cf.Future) -> None:
        try:
            compiled = self._compile(spec)
        except BaseException as e:
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(e)
            return
        with self._lock:
            self._pending.pop(key, None)
            self._done[key] = compiled
            while len(self._done) > self.max_entries:
                self._done.popitem(last=False)
        future.set_result(compiled)

    def _compile(self, spec: StructuredOutputs):
        c = self._compiler
        kind = spec.kind
        if kind == "json":
            # Fixed separators (", " and ": "): free whitespace lets small models loop on spaces.
            return c.compile_json_schema(json.dumps(spec.json_schema), any_whitespace=False, strict_mode=True)
        if kind == "json_object":  # any object, extra properties allowed
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":  # JSON string literals are valid EBNF literals (same escapes)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
        return c.compile_grammar(spec.grammar)


@dataclass
class TokenMasks:
    """One step's masks: `bitmask` row i is for sampling row i; only `rows` are constrained."""

    bitmask: torch.Tensor  # int32 (rows, ceil(vocab / 32)), xgrammar's layout
    rows: List[int]

    def select(self, rows: List[int]) -> "TokenMasks":
        """The masks of sampling rows `rows` (a row repeated for forked choices, which sample their
        first token from their parent's logits under the same, not yet advanced, grammar)."""
        constrained = set(self.rows)
        return TokenMasks(self.bitmask[torch.tensor(rows)], [j for j, r in enumerate(rows) if r in constrained])

    def apply(self, logits: torch.Tensor, rows: List[int]) -> None:
        """Masks `logits` in place: its row k is sampling row rows[k] (disallowed tokens -> -inf)."""
        import xgrammar as xgr

        constrained = set(self.rows)
        picked = [k for k, r in enumerate(rows) if r in constrained]
        if picked:
            index = torch.tensor([rows[k] for k in picked])
            xgr.apply_token_bitmask_inplace(logits, self.bitmask[index], indices=picked)


class ConstrainedRows:
    """The matchers of one engine's constrained sequences (engine thread), and their masks."""

    def __init__(self, vocab_size: int, max_rows: int):
        import xgrammar as xgr

        self._matchers: Dict[Sequence, object] = {}
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="iterserve-mask")

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, seq: Sequence, compiled) -> None:
        import xgrammar as xgr

        self._matchers[seq] = xgr.GrammarMatcher(compiled)

    def remove(self, seq: Sequence) -> None:
        self._matchers.pop(seq, None)

    def start(self, seqs: List[Sequence]) -> Optional[cf.Future]:
        """Fills the masks of `seqs`' constrained rows on the worker thread (the forward runs
        meanwhile); None when none is constrained. The result is TokenMasks."""
        rows = [i for i, s in enumerate(seqs) if s in self._matchers]
        if not rows:
            return None
        if len(seqs) > self._bitmask.shape[0]:  # forks and chunked prefills can exceed max_num_seqs
            self._bitmask = self._bitmask.new_full((len(seqs), self._bitmask.shape[1]), -1)
        matchers = [self._matchers[seqs[i]] for i in rows]
        return self._worker.submit(self._fill, rows, matchers)

    def _fill(self, rows: List[int], matchers: List[object]) -> TokenMasks:
        for i, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(self._bitmask, i)
        return TokenMasks(self._bitmask, rows)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advances `seq`'s matcher; False when the grammar refuses `token` (only possible when every
        token it allowed was masked by something else, e.g. min_tokens hiding EOS at the grammar's end)."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return True
        if matcher.accept_token(token):
            return True
        logger.warning("request %s: the grammar refused token %d; the choice ends", seq.request_id, token)
        return False

    def is_complete(self, seq: Sequence) -> bool:
        matcher = self._matchers.get(seq)
        return matcher is not None and matcher.is_terminated()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
