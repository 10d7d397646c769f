"""The ingress's LoRA adapter registry: which names a request's `model` may take, and where each
adapter is, so whichever LLM replica a request reaches can load it.

Names: the served base name (or None) is the base model; `base:adapter` (Ray Serve LLM's form) and
a bare adapter name are adapter `adapter`. Adapter names never contain ':' (batcher.lora_adapter),
so the forms cannot collide. Adapters are the engine's static ones (`engine.lora.adapters`), those
registered through /v1/load_lora_adapter, and, where `engine.lora.dynamic_lora_loading_path` is set,
any name found there (the replica looks; the ingress cannot always tell). Plain data, no Ray: unit-tested.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set

from deployments.errors import APIError, clip


@dataclass(frozen=True)
class ResolvedModel:
    """A request's `model`, resolved: the adapter (None: the base) and its path as far as the ingress knows."""

    lora_name: Optional[str] = None
    lora_path: Optional[str] = None


BASE = ResolvedModel()


def adapter_not_found(name: str, base: str) -> APIError:
    return APIError(
        404,
        f"The model `{clip(name)}` does not exist: it is neither `{base}` nor one of its LoRA "
        "adapters (GET /v1/models lists them; POST /v1/load_lora_adapter adds one).",
        param="model",
        code="model_not_found",
    )


class AdapterRegistry:
    def __init__(self, base: str, lora_config: Optional[dict]):
        """`lora_config`: the engine's `lora` section as a dict (None: the deployment serves no adapters)."""
        cfg = lora_config or {}
        self.base = base
        self.enabled = lora_config is not None
        self.static: Dict[str, str] = dict(cfg.get("adapters") or {})
        self.dynamic_path: Optional[str] = cfg.get("dynamic_lora_loading_path")
        self.registered: Dict[str, str] = {}  # /v1/load_lora_adapter: name -> path
        self.unloaded: Set[str] = set()  # /v1/unload_lora_adapter: refused unless found again
        self._resident: Dict[str, Set[str]] = {}  # replica id -> adapters it reported

    # ---- names ---------------------------------------------------------------------------------------

    def resolve(self, model: Optional[str]) -> ResolvedModel:
        """`model` -> the adapter and its path; a 404 APIError when the name cannot be served."""
        if model is None or model == self.base:
            return BASE
        name = model
        if ":" in model:
            base, _, name = model.rpartition(":")  # adapter names have no ":"; base names may
            if base != self.base or not name:
                raise adapter_not_found(model, self.base)
        if not self.enabled:
            raise adapter_not_found(model, self.base)
        path = self.path_of(name)
        if path is not None:
            return ResolvedModel(name, path)
        if self.dynamic_path is None:  # only configured and registered names exist: known here
            raise adapter_not_found(model, self.base)
        if name in self.unloaded:  # unloaded: served again only if the dynamic path has it
            candidate = os.path.join(self.dynamic_path, name)
            if "://" not in self.dynamic_path and not os.path.isdir(candidate):
                raise adapter_not_found(model, self.base)
            return ResolvedModel(name, candidate)  # reloaded from there, never the unloaded weights
        return ResolvedModel(name, None)  # the replica looks in the dynamic path (404 if absent)

    def path_of(self, name: str) -> Optional[str]:
        if name in self.unloaded:
            return None
        return self.registered.get(name) or self.static.get(name)

    # ---- load / unload -------------------------------------------------------------------------------

    def check_enabled(self) -> None:
        if not self.enabled:
            raise APIError(
                400, "this deployment serves no LoRA adapters: set `engine.lora` in its config", param="lora_name"
            )

    def register(self, name: str, path: str) -> None:
        self.registered[name] = path
        self.unloaded.discard(name)

    def unregister(self, name: str) -> None:
        """404 when `name` is not an adapter this ingress knows of."""
        if name not in self.names():
            raise adapter_not_found(name, self.base)
        self.registered.pop(name, None)
        self.unloaded.add(name)
        for names in self._resident.values():
            names.discard(name)

    # ---- what replicas hold --------------------------------------------------------------------------

    def saw_replica(self, replica_id: Optional[str], loras: Iterable[str]) -> None:
        """A replica's report of the adapters it knows (LLMServer.model_info)."""
        if replica_id is not None:
            self._resident[replica_id] = set(loras) - self.unloaded

    def names(self) -> List[str]:
        """Every adapter name a request may use now, as far as this ingress knows (sorted)."""
        known = set(self.static) | set(self.registered)
        for names in self._resident.values():
            known |= names
        return sorted(known - self.unloaded)
