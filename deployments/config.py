"""AppConfig: everything `build_app` needs, validated before anything is deployed.

Every model forbids unknown keys, so a typo in serve_config.yaml fails at deploy time with a
message that names the field (pydantic's `loc`), instead of being silently ignored.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batcher.config import EngineConfig

_STRICT = ConfigDict(extra="forbid", protected_namespaces=())


class ReplicaConfig(BaseModel):
    """Resources and limits of each LLM replica (one engine per replica)."""

    model_config = _STRICT

    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored when autoscaling is set).")
    num_cpus: float = Field(
        0.0, ge=0, description="Logical CPUs Ray reserves; 0 lets replicas share a small machine."
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (1 for the CUDA variant).")
    memory_gib: Optional[float] = Field(None, gt=0, description="Memory Ray reserves per replica.")
    max_ongoing_requests: int = Field(
        128, ge=1, description="Requests in flight per replica; beyond it they queue at the caller."
    )
    max_queued_requests: int = Field(
        512, ge=-1, description="Requests queued per caller before overload errors; -1 = unbounded."
    )
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    env_vars: Dict[str, str] = Field(default_factory=dict, description="Extra env vars of replica processes.")


class IngressConfig(BaseModel):
    """The HTTP front (FastAPI) deployment."""

    model_config = _STRICT

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1, description="Open HTTP requests per ingress replica.")
    overload_status_code: Literal[429, 503] = Field(429, description="Status of a request refused for overload.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header sent with overload errors.")


class StreamConfig(BaseModel):
    """How token deltas are grouped into chunks on the way back to callers."""

    model_config = _STRICT

    interval_ms: float = Field(
        20.0, ge=0, description="After the first token (always sent at once), merge deltas arriving "
        "within this window into one chunk: fewer Serve messages, same tokens."
    )
    max_chunks_per_s: Optional[float] = Field(
        100.0, gt=0, description="Budget of chunks per second per replica over all its streams: with "
        "N streams open, each waits at least N / budget seconds between chunks (None: no budget). "
        "Under saturation this keeps Serve's per-message cost off the cores the engine needs."
    )


class AutoscalingConfig(BaseModel):
    """Serve's autoscaling options (a subset, same names); `policy` plugs in a custom policy."""

    model_config = _STRICT

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: Optional[int] = Field(None, ge=0)
    target_ongoing_requests: float = Field(32.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    upscaling_factor: Optional[float] = Field(None, gt=0)
    downscaling_factor: Optional[float] = Field(None, gt=0)
    policy: Optional[str] = Field(None, description="'pkg.mod:fn' custom autoscaling policy.")
    policy_kwargs: Dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        return self

    def to_serve(self) -> dict:
        d = self.model_dump(exclude={"policy", "policy_kwargs"}, exclude_none=True)
        if self.policy:
            d["policy"] = {"policy_function": self.policy, "policy_kwargs": self.policy_kwargs}
        return d


class RouterConfig(BaseModel):
    """Which request router the callers of the LLM deployment use (Serve's RequestRouter API)."""

    model_config = _STRICT

    request_router_class: Optional[str] = Field(
        None, description="'pkg.mod:Cls'; None keeps Serve's power-of-two-choices router."
    )
    request_router_kwargs: Dict[str, Any] = Field(default_factory=dict)
    request_routing_stats_period_s: float = Field(
        1.0, gt=0, description="How often the controller polls record_routing_stats()."
    )

    def to_serve(self) -> dict:
        d: dict = {"request_routing_stats_period_s": self.request_routing_stats_period_s}
        if self.request_router_class:
            d["request_router_class"] = self.request_router_class
            d["request_router_kwargs"] = self.request_router_kwargs
        return d


class AppConfig(BaseModel):
    """Arguments of `deployments.app:build_app` (the `args:` of serve_config.yaml)."""

    model_config = _STRICT

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: Optional[str] = Field(
        None, description="Name clients pass as `model`; default: engine.model."
    )
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    autoscaling: Optional[AutoscalingConfig] = None
    router: RouterConfig = Field(default_factory=RouterConfig)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
