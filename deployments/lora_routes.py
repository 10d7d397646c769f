"""What the ingress's LoRA endpoints do: load (validated on one LLM replica, then registered here),
unload (unregistered here, dropped by every replica Serve can reach), and the adapters' model cards.

Calls to replicas carry `multiplexed_model_id=<adapter>`, so the router (Serve's or LLMRouter)
sends a load where the adapter will then be resident and served first.
"""

from __future__ import annotations

import logging
from typing import Callable, List

from ray.serve.handle import DeploymentHandle

from deployments.adapters import AdapterRegistry
from deployments.errors import APIError
from deployments.lora_api import LoadLoRAAdapterRequest, LoRAAdapterResponse, UnloadLoRAAdapterRequest, adapter_card
from deployments.openai_protocol import ModelCard, ModelList
from deployments.protocol import ModelInfo

BROADCAST_TIMEOUT_S = 10.0  # a replica that does not answer within this keeps the adapter until LRU evicts it
ErrorMap = Callable[[Exception], APIError]


def for_adapter(llm: DeploymentHandle, lora_name):
    """The handle a call about adapter `lora_name` goes through (None: the base, the handle itself)."""
    return llm if lora_name is None else llm.options(multiplexed_model_id=lora_name)


async def load(
    llm: DeploymentHandle, registry: AdapterRegistry, body: LoadLoRAAdapterRequest, api_error: ErrorMap
) -> LoRAAdapterResponse:
    """Reads the adapter on one replica (a bad one is a 400 naming the problem, and that replica
    serves on), then registers it: any replica a request reaches loads it from the same path."""
    registry.check_enabled()
    if ":" in body.lora_name:
        raise APIError(
            400, "lora_name must not contain ':' (`base:adapter` names an adapter of a base)", param="lora_name"
        )
    try:
        info = await for_adapter(llm, body.lora_name).load_lora.remote(body.lora_name, body.lora_path)
    except Exception as e:
        raise api_error(e) from None
    registry.register(body.lora_name, body.lora_path)
    return LoRAAdapterResponse(
        message=f"Success: LoRA adapter '{body.lora_name}' added successfully.", lora_name=body.lora_name, info=info
    )


async def unload(
    llm: DeploymentHandle, registry: AdapterRegistry, body: UnloadLoRAAdapterRequest, api_error: ErrorMap
) -> LoRAAdapterResponse:
    """Unregisters the adapter (requests naming it are refused from now on, unless the dynamic
    loading path has it), then asks every replica to drop it, best effort: a replica that misses
    the call never serves it again (the ingress no longer routes the name) and evicts it by LRU."""
    registry.check_enabled()
    registry.unregister(body.lora_name)
    try:
        results = await llm.broadcast("unload_lora", body.lora_name).results_async(
            timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            logging.getLogger("ray.serve").warning(
                "unload of LoRA adapter %r failed on %d replica(s): %s", body.lora_name, len(failed), failed[0]
            )
    except Exception as e:  # a timeout, no replica: the name is unregistered all the same
        logging.getLogger("ray.serve").warning("unload of LoRA adapter %r not broadcast: %s", body.lora_name, e)
    return LoRAAdapterResponse(
        message=f"Success: LoRA adapter '{body.lora_name}' removed successfully.", lora_name=body.lora_name
    )


async def model_list(llm: DeploymentHandle, registry: AdapterRegistry, info: ModelInfo) -> ModelList:
    """The base model and every adapter: configured, registered, and the ones replicas report."""
    if registry.enabled:
        try:
            infos: List = await llm.broadcast("model_info").results_async(
                timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True
            )
        except Exception:  # the list is still right for configured and registered adapters
            infos = []
        for i in infos:
            if isinstance(i, ModelInfo):
                registry.saw_replica(i.replica_id, i.loras)
    base = ModelCard(id=registry.base, root=registry.base, max_model_len=info.max_model_len, simulation=info.simulation)
    return ModelList(
        data=[base] + [adapter_card(n, registry.base, info.max_model_len, info.simulation) for n in registry.names()]
    )
