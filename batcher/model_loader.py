"""Loads a model's weights for the engine (batcher.model_files says where its files are) and resolves
the device, dtype and quantization it runs with."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from batcher.model_files import EMBEDDED_MODEL, TINY_MODEL, embedded_model_dir, load_tokenizer, tiny_llama_config
from batcher.quantization import QUANTIZATIONS, quantize_linears

logger = logging.getLogger(__name__)


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


def load_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0, quantization: Optional[str] = None):
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
        logger.warning(
            "quantization %s needs bfloat16 activations, which this device does not compute "
            "natively (no AVX512_BF16 or AMX): serving float32 weights, unquantized",
            quantization,
        )
        return None
    return quantization


def eos_token_ids(model, tokenizer) -> set:
    """The tokenizer's EOS and the generation config's (a model may have several)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return ids
