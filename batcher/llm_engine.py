"""LLMEngine: model + scheduler + sampler, one step at a time. Single-threaded; AsyncLLMEngine
drives it from its own thread."""

from __future__ import annotations

import copy
import time
from typing import Dict, List, Optional, Union
from typing import Sequence as Seq

import torch

from batcher import simulated
from batcher.block_manager import BlockManager
from batcher.config import EngineConfig
from batcher.engine_input import EngineInput, Prompt
from batcher.engine_request import EngineChoice, EngineRequest
from batcher.errors import InvalidRequestError, StepError
from batcher.grammar import ConstrainedRows
from batcher.lora_runtime import LoRARuntime
from batcher.model_files import context_length, kv_block_bytes, load_tokenizer
from batcher.model_loader import eos_token_ids, load_model, resolve_device, resolve_dtype, resolve_quantization
from batcher.outputs import Completion, EngineSnapshot, EngineStats, StreamDelta, completions_by_choice
from batcher.request_builder import RequestBuilder
from batcher.sampler import Sampler
from batcher.sampling_params import SamplingParams
from batcher.scheduler import Scheduler, SchedulerOutput
from batcher.trace import OccupancyTrace


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.model
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._threads = torch.get_num_threads()  # per step: this, or small_step_threads for small steps
        # "sim:<preset>": the same engine with a step-time model in place of the forward.
        self.simulation = simulated.preset_for(config.model) if simulated.is_simulated(config.model) else None
        self.device = resolve_device("cpu" if self.simulation else config.device)
        if self.simulation:
            self.dtype = getattr(torch, self.simulation.kv_dtype)
            self.tokenizer = load_tokenizer(config.model)
            mcfg = simulated.SimulatedModelConfig(self.simulation, len(self.tokenizer))
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        else:
            self.dtype = resolve_dtype(config.dtype, self.device)
            model, self.tokenizer = load_model(
                config.model,
                self.dtype,
                self.device,
                config.seed,
                resolve_quantization(config.quantization, config.dtype, self.dtype),
            )
            mcfg = model.config
            self.eos_token_ids = eos_token_ids(model, self.tokenizer)
        # The engine thread detokenizes while callers encode: give it its own tokenizer object.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        self.vocab_size = mcfg.vocab_size
        self.max_model_len = context_length(mcfg, config.max_model_len)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(mcfg)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # LoRA adapters: slots in the model's linear layers (before the runner builds its forward).
        self.lora = LoRARuntime(config.lora, None if self.simulation else model) if config.lora else None
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.watermark,
            config.static_batch_size if config.scheduling == "static" else None,
            self.lora and self.lora.slots,
        )
        if self.simulation:
            answer_ids = self.tokenizer(simulated.ANSWER_TEXT, add_special_tokens=False)["input_ids"]
            self.runner = simulated.SimulatedRunner(self.simulation, answer_ids, self.tokenizer.eos_token_id)
            self.sampler = simulated.SimulatedSampler()
        else:
            # Here, not at the top: a simulated replica never imports the forward's modules (transformers'
            # attention integrations and torch's compiler: ~3 s of CPU a replica start on a Zen 3 core).
            from batcher.model_runner import ModelRunner

            self.runner = ModelRunner(
                model,
                num_blocks,
                config.block_size,
                self.dtype,
                self.device,
                config.attention_backend,
                compile=config.compile,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                thread_counts={self._threads, config.small_step_threads or self._threads},
                lora=self.lora and self.lora.model,
            )
            self.sampler = Sampler(config.seed, self.eos_token_ids)
        self.requests: Dict[str, EngineRequest] = {}
        self.builder = RequestBuilder(
            self.model_name,
            self.tokenizer,
            self._detok_tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.kv_capacity_tokens,
            self.eos_token_ids,
            config.grammar_compile_timeout_s,
            self.simulation is not None,
            self.lora,
        )
        self.constrained: Optional[ConstrainedRows] = None  # made on the first constrained request
        self.counters = EngineStats(kv_blocks_total=num_blocks)
        self.last_step_time = time.monotonic()
        self.trace = OccupancyTrace(config.trace_steps) if config.trace_steps else None

    def _blocks_for_memory(self, mcfg) -> int:
        c = self.config
        per_block = kv_block_bytes(mcfg, c.block_size, self.dtype.itemsize)
        # No more than the batch could ever fill (small models would otherwise get millions).
        most_useful = -(-c.max_num_seqs * self.max_model_len // c.block_size)
        memory_gib = c.kv_cache_memory_gib
        if self.simulation and "kv_cache_memory_gib" not in c.model_fields_set:
            memory_gib = self.simulation.kv_cache_memory_gib  # the simulated device's, not this machine's
        return max(1, min(int(memory_gib * 2**30) // per_block, most_useful))

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens one request may hold: the whole cache less the admission watermark."""
        return (self.block_manager.num_blocks - self.scheduler.watermark_blocks) * self.block_manager.block_size

    @property
    def max_request_tokens(self) -> int:
        """The longest prompt + max_tokens this engine admits."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    # -- requests -----------------------------------------------------------------------------
    def make_request(self, inp: EngineInput) -> EngineRequest:
        """Validates, tokenizes, compiles a constraint, loads the adapter (RequestBuilder.build); any
        thread may call it."""
        return self.builder.build(inp)

    def load_lora(self, name: str, path: str) -> dict:
        """Reads, checks and holds adapter `name` (any thread); InvalidRequestError names what is wrong."""
        return self._lora_runtime().load(name, path).info()

    def unload_lora(self, name: str) -> bool:
        return self._lora_runtime().unload(name)

    def lora_names(self) -> List[str]:
        return self.lora.names() if self.lora is not None else []

    def _lora_runtime(self) -> LoRARuntime:
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (engine.lora is unset)", "lora")
        return self.lora

    def add(self, request: EngineRequest) -> None:
        rid = request.seq.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        self.requests[rid] = request
        if request.adapter is not None:
            self.lora.added(request.adapter, request.seq.num_prompt_tokens)
        if request.grammar is not None:
            if self.constrained is None:
                self.constrained = ConstrainedRows(self.vocab_size, self.config.max_num_seqs)
            self.constrained.add(request.seq, request.grammar)
        self.scheduler.add(request.seq)
        self.counters.prompt_tokens += request.seq.num_prompt_tokens

    def add_request(self, inp: EngineInput) -> str:
        """make_request, then add: the request's id."""
        request = self.make_request(inp)
        self.add(request)
        return request.seq.request_id

    def abort(self, request_id: str) -> Optional[StreamDelta]:
        """abort_choices' first delta (choice 0's, the only one when n = 1), or None if unknown."""
        return next(iter(self.abort_choices(request_id)), None)

    def abort_choices(self, request_id: str) -> List[StreamDelta]:
        """Frees the request's blocks at once; returns the final delta of each choice that had not
        finished (choices not forked yet included), none if the request is unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        open_choices = [c for c in request.choices if not c.seq.is_finished]
        self._finish(request, "abort")
        self.counters.aborted_requests += 1
        return [c.delta() for c in open_choices] + request.unforked_deltas("abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> List[StreamDelta]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if out.preempted:
                return []
            # Admission checks make this unreachable; if it ever happens, fail loudly, don't spin.
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting")
        self._set_threads(out.num_tokens)
        sampling = [s.seq for s in out.scheduled if s.samples]
        t1 = time.perf_counter()
        try:
            # Constrained rows' masks are filled on a worker thread while the forward runs.
            filling = self.constrained.start(sampling) if self.constrained else None
            logits = self.runner.execute(out.scheduled, self.lora.step_slots(out.scheduled) if self.lora else None)
            t2 = time.perf_counter()
            masks = filling.result() if filling is not None else None
            # n = 1 (nearly every row) is decided without a lookup: the step loop is hot.
            forks = {
                seq: [seq.fork(i) for i in range(1, seq.params.n)]
                for seq in sampling
                if seq.params.n > 1 and len(self.requests[seq.request_id].choices) < seq.params.n
            }
            if forks:  # each new choice samples its first token from its parent's logits
                rows = [i for i, seq in enumerate(sampling) for _ in range(1 + len(forks.get(seq, ())))]
                sampling = [c for seq in sampling for c in (seq, *forks.get(seq, ()))]
                logits = logits[torch.tensor(rows)] if torch.is_tensor(logits) else [logits[i] for i in rows]
                masks = masks.select(rows) if masks is not None else None
            tokens, logprobs = self.sampler.sample(logits, sampling, masks)
        except Exception as e:  # a kernel error, NaN probabilities, device OOM: this step's requests only
            raise self._fail_step(out, e) from e
        self.scheduler.update_after_step(out)
        for parent, children in forks.items():  # the prompt's K/V is computed now: share it
            pairs = self.scheduler.fork(parent, children)
            if not self.simulation:  # a simulated runner holds no K/V
                self.runner.kv_cache.copy_blocks(pairs)
            request = self.requests[parent.request_id]
            request.choices += [self.builder.choice(c) for c in children]
            for child in children if request.grammar is not None else ():
                self.constrained.add(child, request.grammar)
        c = self.counters
        c.tokens_computed += out.num_tokens
        c.kv_slot_use_sum += self.scheduler.kv_slot_use()
        deltas = []
        for seq, token, lp in zip(sampling, tokens, logprobs):
            request = self.requests[seq.request_id]
            choice = request.choices[seq.index]
            seq.append_token(token)
            if lp is not None:
                choice.logprobs.append(lp)
            refused = self.constrained is not None and not self.constrained.accept(seq, token)
            reason = "stop" if refused else self._stop_reason(choice, token)
            if reason:
                self.scheduler.finish(seq, reason)
                if request.finished:
                    self._finish(request, reason)
            deltas.append(choice.delta())
        if self.trace is not None:
            self.trace.record(
                out.scheduled, {s.request_id for s in self.scheduler.running}, len(self.scheduler.waiting)
            )
        c.generated_tokens += len(tokens)
        c.steps += 1
        c.forward_seconds += t2 - t1
        c.step_seconds += time.perf_counter() - t0
        self.last_step_time = time.monotonic()
        return deltas

    def _fail_step(self, out: SchedulerOutput, error: Exception) -> StepError:
        """Ends `out`'s requests and frees their blocks; none reached the prefix cache (update_after_step
        did not run), so K/V the failed forward half wrote is never reused. Nothing else changes."""
        ids = tuple(dict.fromkeys(s.seq.request_id for s in out.scheduled))  # choices of one request: once
        for rid in ids:
            self._finish(self.requests[rid], "error")
        self.counters.failed_steps += 1
        self.counters.failed_requests += len(ids)
        return StepError(f"engine step failed: {type(error).__name__}: {error}", ids)

    def _set_threads(self, num_tokens: int) -> None:
        small = self.config.small_step_threads
        want = small if small and num_tokens <= self.config.small_step_tokens else self._threads
        if want != torch.get_num_threads():
            torch.set_num_threads(want)

    def _stop_reason(self, choice: EngineChoice, token: int) -> Optional[str]:
        seq, p = choice.seq, choice.seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if choice.detokenizer.add(seq.output_token_ids) is not None:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, request: EngineRequest, reason: str) -> None:
        """Ends the request: its open choices with `reason` (finished ones keep theirs)."""
        for choice in request.choices:
            self.scheduler.finish(choice.seq, reason)
            if self.constrained is not None:
                self.constrained.remove(choice.seq)
        self.sampler.forget(request.seq.request_id)
        generated = sum(c.seq.num_output_tokens for c in request.choices)
        if request.adapter is not None:
            self.lora.finished(request.adapter)
            self.lora.generated(request.adapter.name, generated)
        del self.requests[request.seq.request_id]
        self.counters.finished_requests += reason not in ("abort", "error")
        self.counters.ended_output_tokens += generated

    # -- offline ------------------------------------------------------------------------------
    def generate(
        self, prompts: Union[Prompt, Seq[Prompt]], params: Union[None, SamplingParams, Seq[SamplingParams]] = None
    ) -> List[Completion]:
        """Offline: runs prompts to completion, in order, with `params` (one for all or one each; None:
        SamplingParams' defaults); a single prompt (str or token ids) is a list of one. A request with
        n > 1 gives n completions in a row (Completion.index 0..n-1)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [
            self.make_request(EngineInput(p, sp if sp is not None else SamplingParams()))
            for p, sp in zip(prompts, params)
        ]
        for r in requests:
            self.add(r)
        deltas: Dict[str, List[StreamDelta]] = {r.seq.request_id: [] for r in requests}
        try:
            while self.has_unfinished():
                for d in self.step():
                    deltas[d.request_id].append(d)
        except StepError:  # the caller gets the error; its other requests leave the engine too
            for r in requests:
                self.abort(r.seq.request_id)
            raise
        return [c for r in requests for c in completions_by_choice(r.seq.prompt_token_ids, deltas[r.seq.request_id])]

    def held_request_ids(self) -> List[str]:
        """Ids of the requests waiting or running (request routers match them against their own)."""
        queues = (self.scheduler.waiting, self.scheduler.running)
        return list(dict.fromkeys(q.request_id for queue in queues for q in queue))  # a request's choices: once

    def stats(self) -> EngineStats:
        """Counters and queue state now. Engine-thread only: other threads read snapshot()'s copy."""
        s = copy.copy(self.counters)
        s.waiting, s.running = len(self.scheduler.waiting), len(self.scheduler.running)
        s.preemptions = self.scheduler.num_preemptions
        s.kv_blocks_free = self.block_manager.num_free_blocks
        s.kv_usage = 1.0 - s.kv_blocks_free / s.kv_blocks_total
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        s.seconds_since_last_step = time.monotonic() - self.last_step_time
        s.queued_prefill_tokens = sum(q.num_tokens - q.num_computed_tokens for q in self.scheduler.waiting) + sum(
            q.num_prompt_tokens - q.num_computed_tokens
            for q in self.scheduler.running
            if q.num_computed_tokens < q.num_prompt_tokens
        )
        s.context_tokens = sum(q.num_tokens for q in self.scheduler.running)
        s.simulation = self.simulation.name if self.simulation else ""
        if self.lora is not None:
            s.resident_loras, s.lora_counters = self.lora.resident(), self.lora.counters()
        return s

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(self.stats(), tuple(self.held_request_ids()), self.last_step_time)
