"""Engine configuration: the one pydantic model every layer reads its settings from."""

from __future__ import annotations

import os
from typing import Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batcher import simulated


class LoRAConfig(BaseModel):
    """Multi-LoRA serving (batcher/lora_adapter.py): PEFT adapters on the base model, several per batch."""

    model_config = ConfigDict(extra="forbid")

    adapters: Dict[str, str] = Field(
        default_factory=dict,
        description="Adapters by name: a local directory "
        "in PEFT's format (adapter_config.json + adapter_model.safetensors).",
    )
    dynamic_lora_loading_path: Optional[str] = Field(
        None,
        description="A directory (or an fsspec URI, fsspec installed) holding adapters as <name>/: a "
        "request naming an adapter not listed loads it from there on first use.",
    )
    max_loras: int = Field(4, ge=1, description="Distinct adapters in one batch (preallocated weight slots).")
    max_cpu_loras: Optional[int] = Field(
        None,
        ge=1,
        description="Adapters held in memory per replica, least recently used evicted first "
        "(never one a request in flight uses). None: max(max_loras, 8).",
    )
    max_lora_rank: int = Field(16, ge=1, le=512, description="Largest adapter rank accepted (slots are this wide).")

    @model_validator(mode="after")
    def _cpu_holds_a_batch(self) -> "LoRAConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        return self

    @property
    def memory_slots(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, 8)


class EngineConfig(BaseModel):
    """Settings of one engine (one replica's batching loop)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(
        "smollm2-135m-instruct",
        description="'smollm2-135m-instruct' (embedded), 'tiny-llama' (random, for tests), "
        "a local HF model directory, a hub id, or 'sim:<preset>' (a simulated replica: real scheduler "
        "and KV bookkeeping, the forward replaced by a step-time model; see batcher/simulated.py).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="'auto' picks cuda when available, else cpu.")
    compile: Literal["auto", "off", "inductor"] = Field(
        # The environment sets the default (the test suite builds dozens of engines eagerly).
        default_factory=lambda: os.environ.get("ITERSERVE_COMPILE", "auto"),
        validate_default=True,
        description="'inductor': torch.compile the forward (one dynamic graph; a model that "
        "cannot be compiled fails the start). 'auto': compile where compiling is measured to pay (see "
        "docs/forward.md), eagerly otherwise; a model that cannot be compiled runs eagerly after one "
        "log line. 'off': eager. Unset: $ITERSERVE_COMPILE, else 'auto'.",
    )
    quantization: Optional[Literal["int8"]] = Field(
        None, description="'int8': weight-only int8 linear layers (activations stay in `dtype`)."
    )
    attention_backend: Literal["auto", "reference", "cpu", "triton"] = Field(
        "auto",
        description="Paged-attention implementation; 'auto' picks by device. 'reference' is the "
        "gather + SDPA oracle the others are tested against.",
    )
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one step's batch.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Token budget of one step.")
    block_size: int = Field(8, ge=1, le=256, description="Tokens per KV block.")
    num_kv_blocks: Optional[int] = Field(None, ge=1, description="Overrides kv_cache_memory_gib.")
    kv_cache_memory_gib: float = Field(1.0, gt=0, description="KV cache budget when num_kv_blocks is unset.")
    watermark: float = Field(0.01, ge=0, lt=1, description="Share of KV blocks kept free when admitting.")
    enable_prefix_caching: bool = True
    scheduling: Literal["continuous", "static"] = "continuous"
    static_batch_size: int = Field(16, ge=1, description="Batch size when scheduling is 'static'.")
    max_model_len: Optional[int] = Field(None, ge=1, description="Default: the model's context length.")
    num_threads: Optional[int] = Field(None, ge=1, description="torch CPU threads; default: all cores.")
    small_step_threads: Optional[int] = Field(
        None,
        ge=1,
        description="torch CPU threads for steps of at most small_step_tokens tokens. Small "
        "decode batches are memory-bound: one thread is about as fast as two, and the other core is then "
        "free for the serving processes (HTTP, Serve's messages). None: num_threads for every step.",
    )
    small_step_tokens: int = Field(8, ge=1, description="Largest step (in tokens) run on small_step_threads.")
    seed: int = 0
    lora: Optional[LoRAConfig] = Field(None, description="Serve LoRA adapters of the model (None: the base only).")
    grammar_compile_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A structured output whose grammar takes longer to compile is refused (400); "
        "its compile finishes in the background and is cached for the next request.",
    )
    trace_steps: int = Field(0, ge=0, description="Record batch occupancy for this many steps (0: off).")
    stall_timeout_s: Optional[float] = Field(
        None,
        gt=0,
        description="check_health fails when the loop has had work but completed no step for "
        "this long; None: max(60 s, 20 x the slowest step so far), so a slow CPU step never trips it.",
    )

    @field_validator("model")
    @classmethod
    def _check_simulation(cls, model: str) -> str:
        if simulated.is_simulated(model):
            simulated.preset_for(model)  # names the known presets when this one is not
        return model

    @model_validator(mode="after")
    def _lora_on_float_linears(self) -> "EngineConfig":
        if self.lora is not None and self.quantization is not None:
            raise ValueError("lora: adapters run on float linear layers; unset quantization to serve them")
        return self

    @model_validator(mode="after")
    def _check_static(self) -> "EngineConfig":
        if self.scheduling == "static" and self.static_batch_size > self.max_num_seqs:
            raise ValueError(
                f"static_batch_size ({self.static_batch_size}) must not exceed max_num_seqs ({self.max_num_seqs})"
            )
        return self
