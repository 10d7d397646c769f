"""LoRA adapters in PEFT's format: read from a directory, checked against the model they will run
on, and held in memory (AdapterStore, least recently used evicted first).

A bad adapter is refused at load with an InvalidRequestError naming the problem (param "lora"):
missing files, another base model's shapes, a rank over max_lora_rank, modules that are not this
model's decoder linear layers, PEFT features this engine does not apply (DoRA, biases, per-module
ranks, extra trained modules).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from batcher.errors import InvalidRequestError

PARAM = "lora"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # also a safe directory name under the dynamic path
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    digest: str  # of the weights file: the same name with other weights is another adapter to the cache
    weights: Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B x scaling (out, r)), fp32

    def info(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "rank": self.rank,
            "digest": self.digest,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in self.weights}),
        }


def check_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise InvalidRequestError(
            f"LoRA adapter name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            PARAM,
        )
    return name


def _bad(name: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {name!r}: {problem}", PARAM)


def read_adapter(name: str, path: str, targets: Dict[str, Tuple[int, int]], max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at `path`. targets: the model's adaptable modules -> (in, out)."""
    directory = Path(path)
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        raise _bad(name, f"no adapter_config.json in {path} (a PEFT adapter directory is expected)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise _bad(name, f"adapter_config.json is not JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad(name, f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise _bad(name, f"rank {rank} is over max_lora_rank {max_rank} (engine.lora.max_lora_rank)")
    for key, fine in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, fine) != fine:
            raise _bad(name, f"{key}={config.get(key)!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise _bad(name, f"{key} is not supported (one rank and alpha for every module, no extra trained modules)")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    state, digest = _read_weights(name, directory)
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key)
        if match is None:
            raise _bad(
                name,
                f"weight {key!r} is not a LoRA A/B matrix of a linear layer (embeddings and "
                "extra trained modules are not supported)",
            )
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise _bad(name, "no LoRA weights in the adapter")
    weights = {}
    for module, ab in sorted(pairs.items()):
        if module not in targets:
            raise _bad(
                name,
                f"targets {module!r}, which is not a decoder linear layer of this model (e.g. {next(iter(targets))!r})",
            )
        if set(ab) != {"A", "B"}:
            raise _bad(name, f"{module!r} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = targets[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise _bad(
                name,
                f"{module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this model needs "
                f"A ({rank}, {fan_in}) and B ({fan_out}, {rank}): it was made for another base model",
            )
        weights[module] = (a.contiguous(), (b * scaling).contiguous())
    return LoRAAdapter(name, str(path), rank, digest, weights)


def _read_weights(name: str, directory: Path) -> Tuple[Dict[str, torch.Tensor], str]:
    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        file = directory / "adapter_model.bin"
    if not file.is_file():
        raise _bad(name, f"no adapter_model.safetensors (or .bin) in {directory}")
    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load

            return load(data), digest
        return torch.load(file, map_location="cpu", weights_only=True), digest
    except Exception as e:  # a truncated or foreign file
        raise _bad(name, f"cannot read {file.name}: {type(e).__name__}: {e}") from None


def adaptable_modules(model: torch.nn.Module) -> Dict[str, Tuple[int, int]]:
    """The decoder layers' linear modules, by name as PEFT writes it -> (in, out)."""
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in name
    }


class AdapterStore:
    """Adapters in memory by name, at most `capacity`, least recently used evicted first; adapters
    that requests in flight use are pinned and never evicted. Thread-safe: loads run on callers'
    threads, pins on the engine's."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._adapters: "OrderedDict[str, LoRAAdapter]" = OrderedDict()
        self._pins: Dict[str, int] = {}
        self._lock = threading.Lock()
        self.evictions: Dict[str, int] = {}
        self.loads: Dict[str, int] = {}

    def get(self, name: str) -> Optional[LoRAAdapter]:
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is not None:
                self._adapters.move_to_end(name)
            return adapter

    def put(self, adapter: LoRAAdapter) -> None:
        with self._lock:
            self._adapters[adapter.name] = adapter
            self._adapters.move_to_end(adapter.name)
            self.loads[adapter.name] = self.loads.get(adapter.name, 0) + 1
            for name in list(self._adapters):
                if len(self._adapters) <= self.capacity:
                    break
                if not self._pins.get(name) and name != adapter.name:
                    del self._adapters[name]
                    self.evictions[name] = self.evictions.get(name, 0) + 1

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def pin(self, name: str, delta: int) -> None:
        with self._lock:
            self._pins[name] = self._pins.get(name, 0) + delta
            if self._pins[name] <= 0:
                del self._pins[name]

    def resident(self) -> Dict[str, LoRAAdapter]:
        with self._lock:
            return dict(self._adapters)
