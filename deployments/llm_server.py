"""The LLM replica: owns one AsyncLLMEngine and serves typed requests through Serve handles.

It streams coalesced token chunks, reports load to the request router and the autoscaler, and
fails its health check when the engine loop is dead or stuck, so Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import AsyncIterator, Dict, List, Optional

from ray import serve

from batcher.outputs import Completion, completions_by_choice, merge_by_choice
from batcher.simulated import PRESETS
from deployments import metrics
from deployments.coalesce import coalesce
from deployments.config import StreamConfig
from deployments.errors import APIError, engine_error
from deployments.protocol import (
    GenerateChunk,
    GeneratedChoice,
    GenerateResponse,
    ModelInfo,
    OutputLogprob,
    PreparedRequest,
    TopLogprob,
)
from router.cost_model import StepMeter

# Fault injection (stall_engine_for_tests, fail_engine_steps_for_tests) works only in replicas
# started with this set to "1".
TEST_HOOKS_ENV = "ITERSERVE_ENABLE_TEST_HOOKS"


@serve.deployment(name="LLMServer")
class LLMServer:
    def __init__(
        self,
        engine_config: dict,
        served_model_name: str,
        stream_config: Optional[dict] = None,
        cost_model: Optional[str] = None,
        eviction_stride: int = 1,
    ):
        """`cost_model`: the step-time preset its measured step times are shrunk toward (the request
        router's prior, deployments.app.default_cost_model); default: a simulated replica's own, else
        the CPU's. `eviction_stride`: its reports name one evicted block of a chain in this many, the
        ones the request router's index keeps (deployments.app.eviction_stride)."""
        from batcher import AsyncLLMEngine, EngineConfig  # torch loads here, not in the ingress

        # The engine sets torch's thread count from the config (Ray gives 0-CPU actors 1 thread).
        config = EngineConfig.model_validate(engine_config)
        self.engine = AsyncLLMEngine(config)
        self.engine.report_evictions_every(eviction_stride)
        self.lora_config = config.lora.model_dump() if config.lora is not None else None
        # Serve's multiplexing: the adapters this replica served lately, reported to the controller so
        # every router (Serve's own too) prefers this replica for them. Bookkeeping only, as long as
        # the engine's LRU: the engine alone loads and evicts (docs/lora.md).
        self._adapter_seen = (
            serve.multiplexed(max_num_models_per_replica=config.lora.memory_slots)(_adapter_seen())
            if config.lora is not None
            else None
        )
        self.tokenizer = self.engine.tokenizer
        self.model_name = served_model_name
        stream = StreamConfig.model_validate(stream_config or {})
        self.interval_s, self.chunk_budget = stream.interval_ms / 1000.0, stream.max_chunks_per_s
        self.open_streams = 0
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.simulation = None
        preset = self.engine.simulation
        if preset is not None:
            self.simulation = f"simulated replica ({preset.name}: {preset.description}); not a real model"
            logging.getLogger("ray.serve").warning("SIMULATION: %s", self.simulation)
        # The longest prompt + max_tokens the engine admits (context window or KV capacity).
        self.max_request_tokens = self.engine.max_request_tokens
        self._token_text: Dict[int, str] = {}
        self.metrics = metrics.ReplicaMetrics(metrics.replica_tags())
        self.step_meter = StepMeter()  # its measured step times, reported to request routers
        self.step_prior = (PRESETS[cost_model] if cost_model in PRESETS else preset or PRESETS["cpu-smollm2"]).step
        self.engine_shape = (config.max_num_seqs, config.max_num_batched_tokens, config.block_size)
        # Serve builds the replica inside its event loop: the refresh runs there until the replica stops.
        self._metrics_task = asyncio.get_running_loop().create_task(self.metrics.refresh_forever(self.engine.stats))

    # ---- requests ------------------------------------------------------------------------------

    async def stream(self, request: PreparedRequest) -> AsyncIterator[GenerateChunk]:
        """Use with `handle.options(stream=True).stream.remote(request)`. Errors come before the
        first chunk; cancelling the call aborts the request and frees its KV blocks. With n > 1 the
        choices' chunks interleave (GenerateChunk.index); the stream ends after each has finished."""
        _check_prepared(request)
        timer, reason, generated = metrics.RequestTimer(), "abort", {}  # "abort": the caller went away
        deltas = self.engine.stream(request.engine_input())
        open_choices = set(range(request.params.n))

        def is_last(d) -> bool:  # called once per delta, in order
            if d.finish_reason is not None:
                open_choices.discard(d.index)
            return not open_choices

        self.open_streams += 1
        try:
            async for batch in coalesce(deltas, self._chunk_interval, is_last=is_last):
                if not generated:
                    await self._saw_adapter(request.lora_name)
                for chunk in self._chunks(batch):
                    timer.saw(len(chunk.token_ids))
                    if not generated:
                        chunk.replica_ttft_s, chunk.replica_sent_at = timer.ttft_s, time.time()
                    reason, generated[chunk.index] = chunk.finish_reason or reason, chunk.completion_tokens
                    yield chunk
        except _ENGINE_ERRORS as e:
            reason = None  # an error, counted where it is answered (the ingress)
            raise engine_error(e, request.prompt_param) from None
        finally:
            self.open_streams -= 1
            if reason is not None:
                self.metrics.finish(timer, reason, sum(generated.values()))

    async def generate(self, request: PreparedRequest) -> GenerateResponse:
        """The whole answer at once. Cancelling the call aborts the request."""
        _check_prepared(request)
        timer, deltas = metrics.RequestTimer(), []
        try:
            async for d in self.engine.stream(request.engine_input()):
                if not deltas:
                    await self._saw_adapter(request.lora_name)
                timer.saw(len(d.token_ids))  # the deltas, unlike engine.generate, time the first token
                deltas.append(d)
        except _ENGINE_ERRORS as e:
            raise engine_error(e, request.prompt_param) from None
        except asyncio.CancelledError:  # the caller went away: the engine request is aborted
            self.metrics.finish(timer, "abort", sum(len(d.token_ids) for d in deltas))
            raise
        outs = completions_by_choice(request.prompt_token_ids, deltas)
        choices = [self._generated_choice(o) for o in outs]
        total = sum(c.completion_tokens for c in choices)  # usage: every choice's tokens, the prompt once
        self.metrics.finish(timer, outs[0].finish_reason, total)
        return GenerateResponse(
            **{**dict(choices[0]), "completion_tokens": total},
            request_id=outs[0].request_id,
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=outs[0].num_cached_tokens,
            replica_id=self.replica_id,
            choices=choices if len(choices) > 1 else [],
            replica_ttft_s=timer.ttft_s,
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self.model_name,
            max_model_len=self.max_request_tokens,
            simulation=self.simulation,
            replica_id=self.replica_id,
            loras=self.engine.lora_names(),
            lora_config=self.lora_config,
        )

    async def load_lora(self, name: str, path: str) -> dict:
        """Reads and checks adapter `name` at `path` and holds it (the ingress's /v1/load_lora_adapter).
        A bad adapter is a 400 APIError naming the problem; this replica serves on."""
        try:
            info = await self.engine.load_lora(name, path)
        except _ENGINE_ERRORS as e:
            raise engine_error(e, "lora_path") from None
        await self._saw_adapter(name)
        return info

    async def unload_lora(self, name: str) -> bool:
        """Drops adapter `name` (requests using it finish first); False where this replica did not know it."""
        return await self.engine.unload_lora(name)

    def stats(self) -> dict:
        """Engine counters of this replica (tests and operators: KV blocks, aborts, ...) and the
        replica process's resident memory (the soak's leak check)."""
        return {"replica_id": self.replica_id, "rss_bytes": _rss_bytes(), **self.engine.stats().as_dict()}

    def stall_engine_for_tests(self, seconds: float) -> None:
        """Blocks the engine loop for `seconds`, as a hung forward would (the health check must then
        fail and Serve replace the replica). Refused unless the replica runs with TEST_HOOKS_ENV=1."""
        _check_test_hooks()
        self.engine.stall_for_tests(seconds)

    def fail_engine_steps_for_tests(self, steps: int = 1) -> None:
        """Makes the engine's next `steps` forwards raise, as a kernel error would: each fails its
        step's requests and the replica serves on. Refused unless TEST_HOOKS_ENV=1, as the stall."""
        _check_test_hooks()
        self.engine.fail_steps_for_tests(steps)

    # ---- Serve hooks ---------------------------------------------------------------------------

    def record_routing_stats(self) -> dict:
        """Polled by the controller; request routers read it as RunningReplica.routing_stats.
        `time_s` stamps it, so a router can tell a stale report from an idle replica; `request_ids`
        lets it tell which of its requests the report counts (router.scoring.counted_in); `step_fit`
        is what this replica measured of its steps since the last minute or two (router.cost_model);
        `evicted`, the prefix-cache blocks it evicted over its last few reports (batcher.eviction_log),
        so routers stop counting them."""
        snap = self.engine.snapshot()  # published by the engine thread: safe to read from this loop
        s, held = snap.stats, list(snap.held_request_ids)
        self.step_meter.observe(s)
        return {
            "time_s": time.time(),
            "waiting": s.waiting,
            "running": s.running,
            "kv_usage": s.kv_usage,
            "kv_blocks_free": s.kv_blocks_free,
            "kv_blocks_total": s.kv_blocks_total,
            "queued_prefill_tokens": s.queued_prefill_tokens,
            "context_tokens": s.context_tokens,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "request_ids": held,
            "step_fit": self.step_meter.fit(),
            "loras": dict(s.resident_loras),
            "evicted": self.engine.cut_evictions(),
        }

    def record_autoscaling_stats(self) -> Dict[str, float]:
        """Custom autoscaling metrics (ctx.aggregated_metrics[name][replica_id] in a policy)."""
        s = self.engine.stats()
        seqs, batched_tokens, block_size = self.engine_shape
        # `finished` and `preemptions` are counters: the policy reads their rate from the raw series.
        stats = {
            "waiting": float(s.waiting),
            "running": float(s.running),
            "kv_usage": float(s.kv_usage),
            "kv_blocks_free": float(s.kv_blocks_free),
            "finished": float(s.finished_requests + s.aborted_requests),
            "preemptions": float(s.preemptions),
        }
        # `capacity`: req/s it would complete running all its slots, from its step times (measured
        # over the last minute or two) and its requests' size. Left out until it knows them: Serve
        # averages each metric over the points it has, and zeros would pull the first ones down.
        capacity = self.step_meter.capacity(self.step_prior, seqs, batched_tokens, s.kv_blocks_total * block_size)
        return {**stats, "capacity": capacity} if capacity > 0 else stats

    def check_health(self) -> None:
        self.engine.check_health()  # raises EngineDeadError: Serve then replaces this replica

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    # ---- helpers -------------------------------------------------------------------------------

    async def _saw_adapter(self, lora_name: Optional[str]) -> None:
        """Counts as a use of `lora_name` in Serve's multiplexing LRU (once the engine took the request,
        so a name no replica can load is never reported)."""
        if lora_name is not None and self._adapter_seen is not None:
            await self._adapter_seen(lora_name)

    def _chunk_interval(self) -> float:
        """Seconds a stream holds deltas before sending a chunk: the configured window, stretched
        under load so all streams together stay within the chunk budget."""
        if not self.chunk_budget:
            return self.interval_s
        return max(self.interval_s, self.open_streams / self.chunk_budget)

    def _chunks(self, deltas: list) -> List[GenerateChunk]:
        """One chunk per choice the deltas carry."""
        return [
            GenerateChunk(
                request_id=d.request_id,
                index=d.index,
                text=d.text,
                token_ids=d.token_ids,
                finish_reason=d.finish_reason,
                logprobs=self._logprobs(d.logprobs) if d.logprobs else None,
                prompt_tokens=d.num_prompt_tokens,
                completion_tokens=d.num_generated_tokens,
                cached_tokens=d.num_cached_tokens,
                replica_id=self.replica_id,
            )
            for d in merge_by_choice(deltas)
        ]

    def _generated_choice(self, out: Completion) -> GeneratedChoice:
        return GeneratedChoice(
            index=out.index,
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=out.finish_reason,
            logprobs=self._logprobs(out.logprobs) if out.logprobs is not None else None,
            completion_tokens=len(out.token_ids),
        )

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, lps: List) -> Optional[List[OutputLogprob]]:
        return [
            OutputLogprob(
                token_id=lp.token_id,
                token=self._text_of(lp.token_id),
                logprob=lp.logprob,
                top_logprobs=[
                    TopLogprob(token_id=t, token=self._text_of(t), logprob=v) for t, v in lp.top_logprobs.items()
                ],
            )
            for lp in lps
        ]


# Engine errors are ValueError / RuntimeError, and LookupError for an adapter no one can find.
_ENGINE_ERRORS = (ValueError, RuntimeError, LookupError)


def _adapter_seen():
    """Serve's multiplexed "model" loader, one per replica (Serve keeps its LRU on the function): the
    adapter's name alone. The engine holds the weights, so Serve's LRU dropping a name only stops
    reporting it (nothing to free: no __del__)."""

    async def adapter_seen(lora_name: str) -> str:
        return lora_name

    return adapter_seen


def _check_prepared(request) -> None:
    if not isinstance(request, PreparedRequest):
        raise APIError(
            400,
            f"LLMServer takes a PreparedRequest, got {type(request).__name__}: send requests "
            "to the ingress app (HTTP or serve.get_app_handle), which prepares them once",
        )


def _check_test_hooks() -> None:
    if os.environ.get(TEST_HOOKS_ENV) != "1":
        raise PermissionError(f"test hooks are off in this replica (set {TEST_HOOKS_ENV}=1 to enable)")


def _rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux); 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
