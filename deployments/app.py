"""`deployments.app:build_app`: AppConfig -> the Serve application (ingress -> LLM replicas).

serve_config.yaml points its `import_path` here and passes AppConfig's fields as `args`.
"""

from __future__ import annotations

import warnings
from typing import Union

import pydantic
from ray.serve import Application
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import RequestRouterConfig

from batcher.simulated import is_simulated, preset_for
from deployments.config import AppConfig
from deployments.ingress import OpenAIIngress
from deployments.llm_server import LLMServer
from deployments.shutdown import graceful_timeout_s
from router import LLMRouter, LLMRouterConfig


class ConfigError(ValueError):
    """A bad AppConfig, reported with the path of the offending field."""


def _check(fn, what: str):
    try:
        return fn()
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in (what, *err["loc"]) if p != "")
        raise ConfigError(f"invalid iterserve config at `{field}`: {err['msg']}") from None
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"invalid iterserve config at `{what}`: {e}") from None


def _runtime_env(env: dict) -> dict:
    return {"runtime_env": {"env_vars": env}} if env else {}


def load_config(args: Union[AppConfig, dict, None]) -> AppConfig:
    if isinstance(args, AppConfig):
        return args
    return _check(lambda: AppConfig.model_validate(args or {}), "args")


def llm_deployment_options(cfg: AppConfig) -> dict:
    r = cfg.replica
    actor_options: dict = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus}
    if r.memory_gib:
        actor_options["memory"] = int(r.memory_gib * 2**30)
    env = {**metric_push_env(cfg), **r.env_vars}
    if env:
        actor_options["runtime_env"] = {"env_vars": env}
    options = {
        "ray_actor_options": actor_options,
        "max_ongoing_requests": r.max_ongoing_requests,
        "max_queued_requests": r.max_queued_requests,
        "health_check_period_s": r.health_check_period_s,
        "health_check_timeout_s": r.health_check_timeout_s,
        "max_replicas_per_node": r.max_replicas_per_node,
        # A leaving replica finishes its streams first (scale-down and redeploys lose nothing).
        "graceful_shutdown_wait_loop_s": r.graceful_shutdown_wait_loop_s,
        "graceful_shutdown_timeout_s": r.graceful_shutdown_timeout_s
        or _check(
            lambda: graceful_timeout_s(cfg.engine, r.shutdown_token_s, r.graceful_shutdown_wait_loop_s),
            "args.engine.max_model_len",
        ),
        "request_router_config": request_router_config(cfg),
    }
    if cfg.autoscaling is not None:
        auto = cfg.autoscaling.to_serve()
        with warnings.catch_warnings():  # metrics_interval_s is "deprecated" yet the only knob 2.60 reads
            warnings.simplefilter("ignore", DeprecationWarning)
            _check(lambda: ServeAutoscalingConfig(**auto), "args.autoscaling")
        options["autoscaling_config"] = auto  # num_replicas must stay unset then
    else:
        options["num_replicas"] = r.num_replicas
    return options


def request_router_config(cfg: AppConfig) -> RequestRouterConfig:
    """Serve's router config; Serve validates the class (it imports it) here, at deploy. LLMRouter's
    kwargs are validated too, and given the engine's shape so it hashes blocks as replicas cache them."""
    router = _check(lambda: RequestRouterConfig(**cfg.router.to_serve()), "args.router.request_router_class")
    if cfg.router.request_router_class and issubclass(router.get_request_router_class(), LLMRouter):
        e = cfg.engine
        shape = {
            "model": e.model,
            "block_size": e.block_size,
            "max_num_batched_tokens": e.max_num_batched_tokens,
            "max_num_seqs": e.max_num_seqs,
        }
        for key in shape.keys() & cfg.router.request_router_kwargs.keys():
            raise ConfigError(
                f"invalid iterserve config at `args.router.request_router_kwargs.{key}`: "
                f"set from `args.engine.{key}`, so the router hashes blocks as replicas cache them"
            )
        kwargs = {"cost_model": default_cost_model(cfg), **cfg.router.request_router_kwargs, **shape}
        kwargs = _check(lambda: LLMRouterConfig.model_validate(kwargs), "args.router.request_router_kwargs")
        router.request_router_kwargs = kwargs.model_dump()
    return router


def eviction_stride(router: RequestRouterConfig) -> int:
    """LLMRouter's index keeps one block of a chain in `index_stride_blocks`: the replicas report only
    those evicted (it would skip the others). Other routers read no evictions: every block, as logged."""
    if not issubclass(router.get_request_router_class(), LLMRouter):
        return 1
    return LLMRouterConfig.model_validate(router.request_router_kwargs).index_stride_blocks


def default_cost_model(cfg: AppConfig) -> str:
    """A simulated replica's own step times; else an H100's where replicas run on a GPU (device cuda,
    or auto with a GPU reserved: the deploying node may have none), this machine's CPU figures otherwise."""
    engine = cfg.engine
    if is_simulated(engine.model):
        return preset_for(engine.model).name
    on_gpu = engine.device.startswith("cuda") or (engine.device == "auto" and cfg.replica.num_gpus > 0)
    return "h100-llama3-8b" if on_gpu else "cpu-smollm2"


def metric_push_env(cfg: AppConfig) -> dict:
    """Serve's push-interval variables for processes holding handles or serving replicas. Ray 2.60
    takes the interval from autoscaling_config.metrics_interval_s; later versions read these."""
    if cfg.autoscaling is None:
        return {}
    interval = str(cfg.autoscaling.metrics_interval_s)
    return {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": interval,
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": interval,
    }


def ingress_env(cfg: AppConfig) -> dict:
    """The ingress's process env: the push intervals, and with a request router of our own, Serve's
    router on the ingress's event loop instead of a thread of its own (Serve's default). A decision
    of LLMRouter's is CPU work (hashing the prompt, scoring the fleet); in a second thread it holds
    the GIL while the ingress's loop waits to relay streams and take requests, which cost requests
    ~40 ms of TTFT at the median on the routing trace (docs/routing.md)."""
    env = metric_push_env(cfg)
    if cfg.router.request_router_class:
        env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "0"
    return env


def build_app(args: dict) -> Application:
    """Serve application builder. `args` is AppConfig as a dict (or an AppConfig)."""
    cfg = load_config(args)
    llm_options = llm_deployment_options(cfg)
    # The replicas' step-time prior is LLMRouter's (validated above), so both read measurements alike.
    router = llm_options["request_router_config"]
    cost_model = router.request_router_kwargs.get("cost_model") or default_cost_model(cfg)
    llm = LLMServer.options(**llm_options).bind(
        cfg.engine.model_dump(), cfg.model_name, cfg.stream.model_dump(), cost_model, eviction_stride(router)
    )
    # The ingress relays every stream, so a leaving ingress replica (a redeploy replaces it too) waits
    # as long as the LLM replicas do: Serve's 20 s default would cut longer streams.
    shutdown = {k: llm_options[k] for k in ("graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s")}
    ing = cfg.ingress
    ingress = OpenAIIngress.options(
        num_replicas=ing.num_replicas,
        max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus, **_runtime_env(ingress_env(cfg))},
        **shutdown,
    )
    return ingress.bind(llm, cfg.model_name, cfg.engine.model, ing.model_dump())
