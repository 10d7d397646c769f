"""Simulated replicas (`model: "sim:<preset>"`): the real engine with only the forward replaced.

Everything but the model is real: scheduler, block manager, prefix cache, detokenizer, streaming,
and the embedded model's tokenizer and chat template (so prompts, prefixes and usage are real). The
forward becomes a step-time model that sleeps (no core used: eight simulated replicas fit on two
cores) and emits deterministic tokens. It exists to run fleets (routing, autoscaling) on a small
machine; every figure it produces is a simulation and is labelled so.

    step time = fixed + prefill tokens x a + decoding sequences x b + context tokens x c
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from batcher.outputs import TokenLogprob
from batcher.sequence import Sequence

SIM_PREFIX = "sim:"
# The deterministic answer: these words, over and over (each starts with a space, so the text
# re-tokenizes to the same ids and a follow-up turn hits the cache like a real answer would).
ANSWER_TEXT = " This is a simulated answer from the step time model."


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one engine step takes, from what the scheduler put in it."""

    fixed_s: float  # weights read once per step, launch and scheduling overhead
    prefill_token_s: float  # compute per prompt token
    decode_seq_s: float  # per sequence decoding one token (sampling, bookkeeping)
    context_token_s: float  # attention: KV read per token of context, per sequence in the step

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return (
            self.fixed_s
            + prefill_tokens * self.prefill_token_s
            + decode_seqs * self.decode_seq_s
            + context_tokens * self.context_token_s
        )


@dataclass(frozen=True)
class SimPreset:
    """A model on a device: its step times, KV geometry and the engine budgets that fit it."""

    name: str
    description: str
    step: StepTimeModel
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # what the KV cache is stored in on that device
    max_model_len: int
    kv_cache_memory_gib: float  # KV memory of the simulated device (weights and activations taken out)
    mean_answer_tokens: int  # answers end with EOS after a deterministic length around this

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (2 if "16" in self.kv_dtype else 4)


PRESETS: Dict[str, SimPreset] = {
    # Llama-3.1-8B-Instruct, bf16, one H100 SXM 80GB, vLLM-like engine. Derived from published
    # figures by roofline, the way decode-bound serving behaves:
    # - NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16.
    # - Llama 3.1 8B model card / config.json: 8.03e9 parameters (16.1 GB in bf16), 32 layers,
    #   8 KV heads of dim 128 -> 128 KiB of KV per token, 128k context (8k here, a common serving cap).
    # fixed: reading the weights once per step, 16.1 GB / 3.35 TB/s = 4.8 ms, + ~1.2 ms of launch and
    #   scheduling overhead = 6 ms (vLLM reports ~6-7 ms TPOT at batch 1 for 8B on H100: vLLM v0.6.0
    #   blog, Sept 2024; Lambda's vLLM H100 benchmarks).
    # prefill: 2 x 8.03e9 FLOP per token at ~50% of 989 TFLOP/s = 32 us per token (~31k tok/s).
    # context: 128 KiB per token / 3.35 TB/s = 39 ns per token of context per step.
    # decode_seq: ~40 us per sequence per step (sampling, detokenizing, scheduler bookkeeping).
    # KV memory: 80 GB x 0.9 (vLLM's gpu_memory_utilization) - 16.1 GB weights - ~2 GB activations
    #   = ~54 GiB -> ~440k tokens.
    "h100-llama3-8b": SimPreset(
        name="h100-llama3-8b",
        description="Llama-3.1-8B bf16 on one H100 SXM (roofline from published specs)",
        step=StepTimeModel(fixed_s=6.0e-3, prefill_token_s=32e-6, decode_seq_s=40e-6, context_token_s=39e-9),
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype="bfloat16",
        max_model_len=8192,
        kv_cache_memory_gib=54.0,
        mean_answer_tokens=256,
    ),
    # The same model's shape on one H100 SXM 80GB, as THIS engine runs it (its default CUDA path: Triton
    # paged attention, compiled forward replayed as CUDA graphs): measured, not derived. Fitted to 244
    # whole engine steps of a random-weight Llama-3.1-8B-shaped model in bf16 (decode batches of 1-128,
    # prompts of 128 and 1024 tokens, chunks of up to 2048), mean relative error 6.7%, by
    # `python -m load_tests.calibrate_sim --device cuda --config load_tests/configs/llama-3.1-8b-like.json
    # --preset h100-llama3-8b` on 2026-11-27 (docs/routing.md#simulated-replicas). Against the roofline
    # above: prefill 0.71x per token, a step's fixed cost 1.48x (host work per step), a sequence's KV read
    # 4.3x per context token (the Triton kernel is far from the HBM roofline). KV memory as above.
    "h100-llama3-8b-measured": SimPreset(
        name="h100-llama3-8b-measured",
        description="Llama-3.1-8B-shaped bf16 on one H100 SXM, this engine's measured steps (random weights)",
        step=StepTimeModel(fixed_s=8.88e-3, prefill_token_s=22.7e-6, decode_seq_s=8.37e-6, context_token_s=168e-9),
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype="bfloat16",
        max_model_len=8192,
        kv_cache_memory_gib=54.0,
        mean_answer_tokens=256,
    ),
    # Llama-3.1-70B-Instruct, bf16, one node of 8 H100 SXM 80GB with tensor parallelism 8, vLLM-like
    # engine: prefill is costly (2.2x the 8B's per token, on 8 GPUs). Roofline from published figures:
    # - NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3 and 989 TFLOP/s dense BF16 per GPU (x8: 26.8 TB/s).
    # - Llama 3.1 70B model card / config.json: 70.6e9 parameters (141 GB in bf16), 80 layers, 8 KV
    #   heads of dim 128 -> 320 KiB of KV per token (one KV head per GPU under TP 8).
    # fixed: the weights read once per step across the 8 GPUs, 141 GB / 26.8 TB/s = 5.3 ms, + ~4.7 ms
    #   of launch, scheduling and two NVLink all-reduces per layer (160 per step, ~20 us each: an
    #   estimate, not a measurement) = 10 ms.
    # prefill: 2 x 70.6e9 FLOP per token at ~40% of 8 x 989 TFLOP/s (TP 8 loses some MFU to the
    #   all-reduces) = 45 us per token (~22k tok/s).
    # context: 320 KiB per token / 26.8 TB/s = 12 ns per token of context per step.
    # decode_seq: ~40 us per sequence per step, as for the 8B (sampling and bookkeeping, per replica).
    # KV memory: 8 x (80 GB x 0.9 - 17.6 GB of weights - ~3 GB activations) = ~410 GB = ~380 GiB
    #   -> ~1.2M tokens.
    "h100x8-llama3-70b": SimPreset(
        name="h100x8-llama3-70b",
        description="Llama-3.1-70B bf16 on 8 H100 SXM, TP 8 (roofline from published specs)",
        step=StepTimeModel(fixed_s=10.0e-3, prefill_token_s=45e-6, decode_seq_s=40e-6, context_token_s=12e-9),
        num_layers=80,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype="bfloat16",
        max_model_len=8192,
        kv_cache_memory_gib=380.0,
        mean_answer_tokens=256,
    ),
    # Qwen2.5-32B-Instruct with FP8 weights (bf16 KV cache) on one H100 SXM 80GB: in bf16 its 65.5 GB
    # of weights would leave ~4 GB for KV, so one GPU serves it in FP8 (vLLM's `quantization: fp8`).
    # Prefill is the costliest per GPU of the presets. Roofline from published figures:
    # - NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 1979 TFLOP/s dense FP8.
    # - Qwen2.5-32B config.json: 32.8e9 parameters (32.8 GB in FP8), 64 layers, 8 KV heads of dim 128
    #   -> 256 KiB of bf16 KV per token.
    # fixed: 32.8 GB / 3.35 TB/s = 9.8 ms + ~1.2 ms of launch and scheduling overhead = 11 ms.
    # prefill: 2 x 32.8e9 FLOP per token at ~50% of 1979 TFLOP/s = 66 us per token (~15k tok/s).
    # context: 256 KiB per token / 3.35 TB/s = 78 ns per token of context per step.
    # decode_seq: ~40 us per sequence per step, as for the 8B.
    # KV memory: 80 GB x 0.9 - 32.8 GB weights - ~3 GB activations = ~36 GB = ~33.5 GiB -> ~137k tokens.
    "h100-qwen2.5-32b-fp8": SimPreset(
        name="h100-qwen2.5-32b-fp8",
        description="Qwen2.5-32B FP8 weights on one H100 SXM (roofline from published specs)",
        step=StepTimeModel(fixed_s=11.0e-3, prefill_token_s=66e-6, decode_seq_s=40e-6, context_token_s=78e-9),
        num_layers=64,
        num_kv_heads=8,
        head_dim=128,
        kv_dtype="bfloat16",
        max_model_len=8192,
        kv_cache_memory_gib=33.5,
        mean_answer_tokens=256,
    ),
    # SmolLM2-135M-Instruct, fp32, this project's engine on 2 CPU cores (2 torch threads), fitted to
    # 170 step times of the real engine measured here on a quiet machine with
    # `python -m load_tests.calibrate_sim` (2026-11-22; decode batches of 1-64, prompts of 32 and 192
    # tokens, prefill chunks up to 512): mean relative error 6.7%. SmolLM2's KV geometry (30 layers,
    # 3 KV heads of 64).
    "cpu-smollm2": SimPreset(
        name="cpu-smollm2",
        description="SmolLM2-135M fp32 on 2 CPU cores (fitted to this engine's measured steps)",
        step=StepTimeModel(fixed_s=57.5e-3, prefill_token_s=1.5e-3, decode_seq_s=2.13e-3, context_token_s=13.8e-6),
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        kv_dtype="float32",
        max_model_len=2048,
        kv_cache_memory_gib=1.0,
        mean_answer_tokens=64,
    ),
}


def is_simulated(model: str) -> bool:
    return model.startswith(SIM_PREFIX)


def preset_for(model: str) -> SimPreset:
    """'sim:<preset>' -> its preset; a clear error naming the known presets otherwise."""
    name = model[len(SIM_PREFIX) :]
    if name not in PRESETS:
        raise ValueError(
            f"unknown simulation preset {name!r} in model {model!r}; known: {', '.join('sim:' + p for p in PRESETS)}"
        )
    return PRESETS[name]


class SimulatedModelConfig:
    """What the engine reads from a HF model config, for a simulated model."""

    def __init__(self, preset: SimPreset, vocab_size: Optional[int] = None):
        self.vocab_size = vocab_size  # the tokenizer's: None where only the shapes are read
        self.max_position_embeddings = preset.max_model_len
        self.num_hidden_layers = preset.num_layers
        self.num_key_value_heads = preset.num_kv_heads
        self.num_attention_heads = preset.num_kv_heads
        self.head_dim = preset.head_dim
        self.hidden_size = preset.num_kv_heads * preset.head_dim


def step_features(scheduled) -> Tuple[int, int, int]:
    """(prefill tokens, decoding sequences, context tokens) of a step (a list of ScheduledSeq)."""
    prefill = decode = context = 0
    for s in scheduled:
        seq = s.seq
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            decode += 1
        else:
            prefill += s.num_new_tokens
        context += seq.num_computed_tokens + s.num_new_tokens
    return prefill, decode, context


class SimulatedRunner:
    """Stands in for ModelRunner: waits the modelled step time, then returns the next token of each
    sampling sequence (the "logits" SimulatedSampler reads)."""

    def __init__(self, preset: SimPreset, answer_ids: List[int], eos_token_id: int):
        self.preset = preset
        self.answer_ids = answer_ids
        self.eos_token_id = eos_token_id
        self.simulated_seconds = 0.0
        self._last_return = 0.0

    def execute(self, scheduled, lora_slots=None) -> List[int]:
        seconds = self.preset.step.step_seconds(*step_features(scheduled))
        self.simulated_seconds += seconds
        # The engine's own bookkeeping since the previous step (scheduling, detokenizing) is part of
        # a real step's time too: sleep only for the rest, so the modelled rate holds.
        busy = time.monotonic() - self._last_return
        time.sleep(seconds - busy if busy < seconds else seconds)  # a sleeping thread uses no core
        self._last_return = time.monotonic()
        return [self.next_token(s.seq) for s in scheduled if s.samples]

    def next_token(self, seq) -> int:
        """The answer text cycled; EOS after a length fixed by the prompt (unless ignore_eos)."""
        k = seq.num_output_tokens
        if not seq.params.ignore_eos and k + 1 >= self.answer_length(seq.prompt_token_ids):
            return self.eos_token_id
        return self.answer_ids[k % len(self.answer_ids)]

    def answer_length(self, prompt_token_ids: List[int]) -> int:
        mean = self.preset.mean_answer_tokens
        crc = zlib.crc32(bytes(str(prompt_token_ids), "ascii"))  # the same in every process
        return mean // 2 + crc % (mean + 1)


class SimulatedSampler:
    """Stands in for Sampler: the runner already chose the tokens. Logprobs are not simulated (the
    chosen token gets 0.0 and no alternatives), nor are penalties, logit_bias and min_tokens; structured
    outputs are refused (LLMEngine.make_request), so `masks` is always None."""

    def sample(
        self, tokens: List[int], seqs: List[Sequence], masks=None
    ) -> Tuple[List[int], List[Optional[TokenLogprob]]]:
        return tokens, [TokenLogprob(t, 0.0) if s.params.logprobs is not None else None for t, s in zip(tokens, seqs)]

    def forget(self, request_id: str) -> None:
        pass
