"""AppConfig: everything `build_app` needs, validated before anything is deployed.

Every model forbids unknown keys, so a typo in serve_config.yaml fails at deploy time with a
message that names the field (pydantic's `loc`), instead of being silently ignored.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from batcher.config import EngineConfig
from deployments.autoscaling import POLICY_PATH, SERVE_POLICY_PATH, QueueDepthPolicyConfig

_STRICT = ConfigDict(extra="forbid", protected_namespaces=())


class ReplicaConfig(BaseModel):
    """Resources and limits of each LLM replica (one engine per replica)."""

    model_config = _STRICT

    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored when autoscaling is set).")
    num_cpus: float = Field(0.0, ge=0, description="Logical CPUs Ray reserves; 0 lets replicas share a small machine.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (1 for the CUDA variant).")
    memory_gib: Optional[float] = Field(None, gt=0, description="Memory Ray reserves per replica.")
    max_replicas_per_node: Optional[int] = Field(
        None,
        ge=1,
        le=100,
        description="At most this many replicas on one node (a node's loss takes no "
        "more); None: Serve spreads them as best it can.",
    )
    max_ongoing_requests: int = Field(
        128, ge=1, description="Requests in flight per replica; beyond it they queue at the caller."
    )
    max_queued_requests: int = Field(
        512, ge=-1, description="Requests queued per caller before overload errors; -1 = unbounded."
    )
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: Optional[float] = Field(
        None,
        gt=0,
        description="Seconds a leaving replica (scale-down, redeploy) may take to finish its "
        "in-flight streams; None: sized from max_model_len x shutdown_token_s.",
    )
    graceful_shutdown_wait_loop_s: float = Field(
        2.0, gt=0, description="Seconds between a leaving replica's checks for unfinished requests."
    )
    shutdown_token_s: Optional[float] = Field(
        None,
        gt=0,
        description="Seconds per generated token at a full batch, to size the shutdown "
        "window; None: the sim preset's step time, or 0.3 (the embedded model at 64 sequences on 2 cores).",
    )
    env_vars: Dict[str, str] = Field(default_factory=dict, description="Extra env vars of replica processes.")


class LimitsConfig(BaseModel):
    """What one request may ask of the server: the ingress refuses more with a 4xx naming the limit
    (`ingress.limits.<field>`). HTTP and Python-handle requests get the same checks."""

    model_config = _STRICT

    max_body_bytes: Optional[int] = Field(
        None,
        ge=1024,
        description="Largest HTTP request body (413 beyond it, before the body is read in "
        "full). None: max_model_len x bytes_per_token + 64 KiB.",
    )
    max_prompt_chars: Optional[int] = Field(
        None,
        ge=1,
        description="Most characters of prompt text (a prompt string, or all message contents "
        "together), checked before tokenizing. None: max_model_len x bytes_per_token.",
    )
    bytes_per_token: int = Field(
        32,
        ge=1,
        description="Sizes the two limits above from the context window: ~4 characters per "
        "token in English, up to 12 bytes for JSON-escaped non-ASCII text, 8 per token id in a list.",
    )
    max_messages: int = Field(1024, ge=1, description="Most chat messages, and most content parts in one.")
    max_stop: int = Field(16, ge=0, description="Most stop strings (and most stop_token_ids).")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string, in characters.")
    max_top_logprobs: int = Field(20, ge=0, le=20, description="Most alternatives per token (logprobs/top_logprobs).")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries (token ids), as OpenAI allows.")
    max_user_chars: int = Field(256, ge=1, description="Longest `user` field (OpenAI's end-user id).")
    max_request_id_chars: int = Field(256, ge=1, description="Longest request_id a Python caller may set.")
    max_n: int = Field(
        8,
        ge=1,
        le=128,
        description="Most choices (`n`) per request. Each choice is a sequence in the batch "
        "with its own KV blocks past the shared prompt: on a few CPU cores 128 (OpenAI's and vLLM's ceiling) "
        "from one client would fill a replica's batch and starve everyone else's.",
    )
    max_constraint_chars: int = Field(
        65536,
        ge=1,
        description="Largest output constraint: a JSON schema (response_format, structured_outputs, "
        "the tools' parameters together) as JSON text, a regex, a grammar or the choices.",
    )
    max_schema_depth: int = Field(
        32,
        ge=1,
        description="Deepest nesting of a JSON schema (objects and lists inside each other): "
        "compile time grows with it.",
    )
    max_tools: int = Field(128, ge=0, description="Most tools per request (OpenAI's limit).")


class IngressConfig(BaseModel):
    """The HTTP front (FastAPI) deployment."""

    model_config = _STRICT

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1, description="Open HTTP requests per ingress replica.")
    overload_status_code: Literal[429, 503] = Field(429, description="Status of a request refused for overload.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header sent with overload errors.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    api_keys_env: Optional[str] = Field(
        None,
        min_length=1,
        description="Name of an env var of the ingress process holding comma-separated API "
        "keys (set it in the serve_config's runtime_env.env_vars). The keys themselves never appear in config.",
    )
    api_key_file: Optional[str] = Field(
        None, min_length=1, description="Path (on the ingress's node) of a file with one API key per line."
    )
    cors_allow_origins: List[str] = Field(
        default_factory=list, description="Origins allowed by CORS, e.g. ['https://app.example']; [] = CORS off."
    )
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes",
        description="How `tool_choice: auto` answers are read for tool calls: 'hermes' (<tool_call> JSON: "
        "Hermes, Qwen2.5/3, and any model whose template ignores tools, which get the Hermes prompt) or "
        "'llama3_json' (Llama 3.1+ JSON calls).",
    )


class StreamConfig(BaseModel):
    """How token deltas are grouped into chunks on the way back to callers."""

    model_config = _STRICT

    interval_ms: float = Field(
        20.0,
        ge=0,
        description="After the first token (always sent at once), merge deltas arriving "
        "within this window into one chunk: fewer Serve messages, same tokens.",
    )
    max_chunks_per_s: Optional[float] = Field(
        100.0,
        gt=0,
        description="Budget of chunks per second per replica over all its streams: with "
        "N streams open, each waits at least N / budget seconds between chunks (None: no budget). "
        "Under saturation this keeps Serve's per-message cost off the cores the engine needs.",
    )


class AutoscalingConfig(BaseModel):
    """Serve's autoscaling options (same names) plus the policy. The default policy is
    deployments.autoscaling:QueueDepthPolicy (its two knobs, slo_s and startup_s, in `policy_kwargs`;
    the replica's slots are added from the engine config); Serve's own stays selectable
    with `policy: ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy`. Fields left
    unset take the chosen policy's defaults (see POLICY_DEFAULTS)."""

    model_config = _STRICT

    min_replicas: int = Field(1, ge=0, description="0 allows scale to zero (requests wait at the handles).")
    max_replicas: int = Field(1, ge=1)
    initial_replicas: Optional[int] = Field(None, ge=0)
    target_ongoing_requests: float = Field(32.0, gt=0, description="Serve's policy only.")
    metrics_interval_s: float = Field(
        0.5,
        gt=0,
        description="How often replicas and handles push metrics to the controller. Ray 2.60 "
        "reads this field (not the RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S variables, which the "
        "app also sets for later Ray versions) and warns that it is deprecated.",
    )
    look_back_period_s: Optional[float] = Field(None, gt=0)
    upscale_delay_s: Optional[float] = Field(None, ge=0)
    downscale_delay_s: Optional[float] = Field(None, ge=0)
    downscale_to_zero_delay_s: Optional[float] = Field(None, ge=0)
    upscaling_factor: Optional[float] = Field(None, gt=0)
    downscaling_factor: Optional[float] = Field(None, gt=0)
    policy: str = Field(POLICY_PATH, description="'pkg.mod:fn' or 'pkg.mod:Class' autoscaling policy.")
    policy_kwargs: Dict[str, Any] = Field(default_factory=dict)
    # Sequences one replica runs at once, from the engine config (AppConfig sets it): derived, not a knob.
    _replica_slots: Optional[int] = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.policy == POLICY_PATH:
            QueueDepthPolicyConfig(**self.policy_kwargs)  # unknown or bad knobs fail at deploy
        return self

    def to_serve(self) -> dict:
        defaults = POLICY_DEFAULTS.get(self.policy, POLICY_DEFAULTS[SERVE_POLICY_PATH])
        d = {**defaults, **self.model_dump(exclude={"policy", "policy_kwargs"}, exclude_none=True)}
        kwargs = dict(self.policy_kwargs)
        if self.policy == POLICY_PATH and self._replica_slots:
            kwargs["replica_slots"] = self._replica_slots
        d["policy"] = {"policy_function": self.policy, "policy_kwargs": kwargs}
        return d


# Serve's delays and smoothing suit its policy; the queue-depth policy keeps its own dwell before a
# removal and jumps straight to the count a burst needs, so Serve must apply neither on top of it.
POLICY_DEFAULTS: Dict[str, Dict[str, float]] = {
    POLICY_PATH: {
        "look_back_period_s": 5.0,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "downscale_to_zero_delay_s": 0.0,
        "upscaling_factor": 1.0,
        "downscaling_factor": 1.0,
    },
    SERVE_POLICY_PATH: {"look_back_period_s": 30.0, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0},
}


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
    served_model_name: Optional[str] = Field(None, description="Name clients pass as `model`; default: engine.model.")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    autoscaling: Optional[AutoscalingConfig] = None
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _replica_slots_for_the_policy(self) -> "AppConfig":
        # The autoscaling policy sizes with what one replica runs at once: the engine's batch, capped
        # by what Serve sends it.
        if self.autoscaling is not None:
            self.autoscaling._replica_slots = min(self.engine.max_num_seqs, self.replica.max_ongoing_requests)
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model
