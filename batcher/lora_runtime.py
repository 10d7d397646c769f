"""An engine's LoRA adapters end to end: where each name loads from, the adapters in memory, the
batch's weight slots, and per-adapter counters. The engine calls it at a request's build (resolve:
loads the adapter on the caller's thread, so other requests go on), add and finish, and before each
forward (step_slots: copies newly assigned adapters into their slots, gives each sequence its slot).

On a simulated replica adapters are bookkeeping only: any name "loads", with no weights.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Dict, List, Optional

import torch

from batcher.block_hash import adapter_cache_id
from batcher.config import LoRAConfig
from batcher.errors import InvalidRequestError, LoRANotFoundError
from batcher.lora_adapter import PARAM, AdapterStore, LoRAAdapter, adaptable_modules, check_name, read_adapter
from batcher.lora_layers import LoRAModel
from batcher.lora_slots import LoRASlots
from batcher.scheduler import ScheduledSeq

_COUNTERS = ("requests", "prompt_tokens", "generated_tokens", "loads", "evictions")


class LoRARuntime:
    def __init__(self, config: LoRAConfig, model: Optional[torch.nn.Module]):
        """model: the real model, whose decoder linear layers get slots (None: a simulated replica)."""
        self.config = config
        self.targets = adaptable_modules(model) if model is not None else None
        self.model = LoRAModel(model, list(self.targets), config.max_loras, config.max_lora_rank) if model else None
        self.paths: Dict[str, str] = {check_name(n): p for n, p in config.adapters.items()}  # static, then registered
        self.store = AdapterStore(config.memory_slots)
        self.slots = LoRASlots(config.max_loras)
        self._live: Dict[str, List] = {}  # cache id -> [LoRAAdapter, requests in flight]  (engine thread)
        self._counts: Dict[str, Dict[str, int]] = {}
        self._lock = threading.Lock()  # one load per name at a time
        self._loading: Dict[str, threading.Lock] = {}

    # -- names -> adapters (any thread) ---------------------------------------------------------------
    def resolve(self, name: str, path: Optional[str] = None) -> LoRAAdapter:
        """The adapter `name` in memory, loaded first if needed from `path`, the static list, or the
        dynamic loading path. LoRANotFoundError when it is in none of them."""

        def held():  # in memory, and from `path` when the request names one (simulated: any path)
            adapter = self.store.get(name)
            fits = adapter is not None and (path in (None, adapter.path) or self.targets is None)
            return adapter if fits else None

        adapter = held()
        if adapter is not None:
            return adapter
        with self._lock:
            lock = self._loading.setdefault(name, threading.Lock())
        with lock:  # concurrent requests for one cold adapter read it once
            adapter = held()
            if adapter is not None:
                return adapter
            return self.load(name, path or self._find(name))

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Reads `path` as adapter `name` (checked against the model), registers and holds it."""
        check_name(name)
        if self.targets is None:
            adapter = LoRAAdapter(name, path, 0, "sim", {})
        else:
            adapter = read_adapter(name, _local(path, name), self.targets, self.config.max_lora_rank)
        with self._lock:
            self.paths[name] = path
        self.store.put(adapter)
        self._count(name, "loads")
        return adapter

    def unload(self, name: str) -> bool:
        """Forgets `name` (requests in flight finish with it); False when it was not known."""
        with self._lock:
            known = self.paths.pop(name, None) is not None
        return self.store.remove(name) or known

    def names(self) -> List[str]:
        with self._lock:
            return sorted(set(self.paths) | set(self.store.resident()))

    def _find(self, name: str) -> str:
        check_name(name)
        with self._lock:
            path = self.paths.get(name)
        if path is not None:
            return path
        root = self.config.dynamic_lora_loading_path
        if root is None:
            raise LoRANotFoundError(
                f"LoRA adapter {name!r} is not known here (engine.lora.adapters, or load it with /v1/load_lora_adapter)"
            )
        candidate = f"{root.rstrip('/')}/{name}"
        if self.targets is not None and "://" not in root and not Path(candidate).is_dir():
            raise LoRANotFoundError(f"LoRA adapter {name!r} is not in {root} (engine.lora.dynamic_lora_loading_path)")
        return candidate

    # -- requests in flight (engine thread) --------------------------------------------------------
    def added(self, adapter: LoRAAdapter, prompt_tokens: int) -> None:
        self._live.setdefault(self.cache_id(adapter), [adapter, 0])[1] += 1
        self.store.pin(adapter.name, 1)
        self._count(adapter.name, "requests")
        self._count(adapter.name, "prompt_tokens", prompt_tokens)

    def finished(self, adapter: LoRAAdapter) -> None:
        key = self.cache_id(adapter)
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        self.store.pin(adapter.name, -1)
        if entry[1] == 0:
            del self._live[key]

    def generated(self, name: Optional[str], tokens: int = 1) -> None:
        if name is not None:
            self._count(name, "generated_tokens", tokens)

    def step_slots(self, scheduled: List[ScheduledSeq]) -> Optional[List[int]]:
        """Each scheduled sequence's slot (-1: base), after copying in adapters newly given a slot."""
        for slot, key in self.slots.take_loads():
            if self.model is not None:
                self.model.load_slot(slot, self._live[key][0])
        slots = [self.slots.slot_of(s.seq.lora_id) for s in scheduled]
        return slots if any(s >= 0 for s in slots) else None

    def cache_id(self, adapter: LoRAAdapter) -> str:
        return adapter_cache_id(adapter.name, adapter.digest)

    # -- stats (any thread) ----------------------------------------------------------------------------
    def counters(self) -> Dict[str, Dict[str, int]]:
        evictions = dict(self.store.evictions)
        with self._lock:
            out = {n: dict(c) for n, c in self._counts.items()}
        for name, n in evictions.items():
            out.setdefault(name, dict.fromkeys(_COUNTERS, 0))["evictions"] = n
        return out

    def resident(self) -> Dict[str, str]:
        return {name: self.cache_id(a) for name, a in self.store.resident().items()}

    def _count(self, name: str, key: str, n: int = 1) -> None:
        with self._lock:
            counts = self._counts.setdefault(name, dict.fromkeys(_COUNTERS, 0))
            counts[key] += n


def _local(path: str, name: str) -> str:
    """A local directory for `path`: itself, or a copy of an fsspec URI (s3://, gs://, ...)."""
    if "://" not in path or path.startswith("file://"):
        return path[len("file://") :] if path.startswith("file://") else path
    try:
        import fsspec
    except ImportError:
        raise InvalidRequestError(
            f"LoRA adapter {name!r}: {path} is a URI; install fsspec (and its filesystem) to load adapters from it",
            PARAM,
        ) from None
    from batcher.model_files import cache_home

    target = cache_home() / "lora" / name
    try:
        fs, remote = fsspec.core.url_to_fs(path)
        fs.get(remote.rstrip("/") + "/", str(target) + "/", recursive=True)
    except Exception as e:
        raise InvalidRequestError(
            f"LoRA adapter {name!r}: cannot fetch {path}: {type(e).__name__}: {e}", PARAM
        ) from None
    return str(target)
