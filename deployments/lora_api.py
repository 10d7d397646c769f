"""Bodies of the LoRA adapter endpoints, as vLLM names them (`POST /v1/load_lora_adapter`,
`POST /v1/unload_lora_adapter`), and the model card of an adapter in `GET /v1/models`."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from deployments.openai_protocol import ModelCard


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, description="A PEFT adapter directory (or fsspec URI) the replicas can read.")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: Optional[int] = None  # vLLM's body may carry it; names alone identify adapters here


class LoRAAdapterResponse(BaseModel):
    """What the endpoints answer on success (vLLM answers a plain sentence; this is that, as JSON)."""

    message: str
    lora_name: str
    info: Optional[dict] = None  # load: what the replica read (rank, target modules, digest)


def adapter_card(name: str, base: str, max_model_len: Optional[int], simulation: Optional[str]) -> ModelCard:
    return ModelCard(id=name, parent=base, root=name, max_model_len=max_model_len, simulation=simulation)
