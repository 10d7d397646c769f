"""EngineInput -> EngineRequest: the checks, the tokenizing and the grammar compile a request needs
before it enters the engine. Touches no engine state, so any thread may build requests."""

from __future__ import annotations

import threading
import uuid
from typing import List, Optional

from batcher.block_hash import root_hash
from batcher.detokenizer import IncrementalDetokenizer
from batcher.engine_input import EngineInput, Prompt
from batcher.engine_request import EngineChoice, EngineRequest
from batcher.errors import InvalidRequestError, LoRANotFoundError, RequestTooLongError
from batcher.grammar import GrammarCache
from batcher.lora_runtime import LoRARuntime
from batcher.sequence import Sequence
from batcher.structured_outputs import StructuredOutputs


class RequestBuilder:
    def __init__(
        self,
        model_name: str,
        tokenizer,
        detok_tokenizer,
        vocab_size: int,
        max_model_len: int,
        kv_capacity_tokens: int,
        eos_token_ids,
        grammar_compile_timeout_s: float,
        simulated: bool,
        lora: Optional[LoRARuntime] = None,
    ):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self._detok_tokenizer = detok_tokenizer  # the engine thread's own (tokenizers are not thread-safe)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self._eos_token_ids = eos_token_ids
        self._compile_timeout_s = grammar_compile_timeout_s
        self._simulated = simulated
        self._lora = lora
        self.grammars: Optional[GrammarCache] = None  # made on the first constrained request
        self._grammars_lock = threading.Lock()

    def build(self, inp: EngineInput) -> EngineRequest:
        """Validates and tokenizes; loads the LoRA adapter `inp.lora_name` if it is not in memory (from
        `inp.lora_path`, else where the engine's LoRA config says). Requests with different `cache_salt`s
        or adapters never share prefix-cache blocks (batcher.block_hash)."""
        params = inp.params
        if inp.cache_salt is not None and not inp.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string when given")
        ids = self._token_ids(inp.prompt)
        bad = next((t for t in params.logit_bias if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias: token id {bad} is out of the vocabulary [0, {self.vocab_size})")
        needed = len(ids) + params.max_tokens
        for name, limit in (("max_model_len", self.max_model_len), ("the KV cache capacity", self.kv_capacity_tokens)):
            if needed > limit:
                raise RequestTooLongError(
                    name, needed, limit, f"{len(ids)} prompt tokens + max_tokens {params.max_tokens}"
                )
        adapter = self._adapter(inp.lora_name, inp.lora_path)
        lora_id = self._lora.cache_id(adapter) if adapter else None
        seq = Sequence(
            inp.request_id or uuid.uuid4().hex,
            ids,
            params,
            cache_root=root_hash(self.model_name, inp.cache_salt, lora_id),
            lora_id=lora_id,
        )
        grammar = self.compile(params.structured_outputs) if params.structured_outputs is not None else None
        return EngineRequest([self.choice(seq)], grammar, adapter)

    def _adapter(self, name: Optional[str], path: Optional[str]):
        if name is None:
            return None
        if self._lora is None:
            raise LoRANotFoundError(f"LoRA adapter {name!r}: this engine serves no adapters (engine.lora is unset)")
        return self._lora.resolve(name, path)

    def _token_ids(self, prompt: Prompt) -> List[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            return self.tokenizer(prompt)["input_ids"]
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ids

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of `spec` (InvalidRequestError when it cannot compile in time)."""
        if self._simulated:
            raise InvalidRequestError(
                "structured outputs need a real model: a simulated replica chooses no tokens", "structured_outputs"
            )
        with self._grammars_lock:
            if self.grammars is None:
                self.grammars = GrammarCache(
                    self._detok_tokenizer, self.vocab_size, self._eos_token_ids, self._compile_timeout_s
                )
        return self.grammars.compile(spec)

    def choice(self, seq: Sequence) -> EngineChoice:
        """A choice's engine-side state: its detokenizer (stop strings) and logprobs."""
        return EngineChoice(
            seq,
            IncrementalDetokenizer(self._detok_tokenizer, seq.params.stop),
            [] if seq.params.logprobs is not None else None,
        )
