"""AppConfig and the shipped serve_config files: bad configs fail at deploy time, naming the field."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from deployments.app import ConfigError, build_app, llm_deployment_options, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "args,field",
    [
        ({"engine": {"modle": "x"}}, "args.engine.modle"),
        ({"engine": {"max_num_seqs": 0}}, "args.engine.max_num_seqs"),
        ({"replica": {"num_cpus": -1}}, "args.replica.num_cpus"),
        ({"replicas": {}}, "args.replicas"),
        ({"ingress": {"overload_status_code": 500}}, "args.ingress.overload_status_code"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "args.autoscaling"),
        ({"router": {"request_router_class": "no_such_module:Router"}}, "args.router.request_router_class"),
        (
            {"router": {"request_router_class": "router:LLMRouter", "request_router_kwargs": {"load_bond": 2}}},
            "args.router.request_router_kwargs.load_bond",
        ),
        (
            {"router": {"request_router_class": "router:LLMRouter", "request_router_kwargs": {"cost_model": "tpu"}}},
            "args.router.request_router_kwargs.cost_model",
        ),
        ({"engine": {"model": "sim:nope"}}, "args.engine.model"),
        (
            {"router": {"request_router_class": "router:LLMRouter", "request_router_kwargs": {"block_size": 4}}},
            "args.router.request_router_kwargs.block_size",
        ),
    ],
)
def test_bad_config_names_the_field(args, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        build_app(args)


def test_options_follow_the_config():
    pow2 = "ray.serve._private.request_router.pow_2_router:PowerOfTwoChoicesRequestRouter"
    cfg = load_config(
        {
            "replica": {"num_replicas": 3, "num_cpus": 0.5, "max_ongoing_requests": 7, "max_replicas_per_node": 2},
            "router": {"request_router_class": pow2, "request_routing_stats_period_s": 0.5},
        }
    )
    opts = llm_deployment_options(cfg)
    assert opts["num_replicas"] == 3 and opts["max_ongoing_requests"] == 7 and opts["max_replicas_per_node"] == 2
    assert opts["ray_actor_options"]["num_cpus"] == 0.5
    assert opts["request_router_config"].request_routing_stats_period_s == 0.5

    policy = "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"
    auto = llm_deployment_options(
        load_config(
            {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "policy": policy, "policy_kwargs": {"a": 1}}}
        )
    )
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["policy"] == {"policy_function": policy, "policy_kwargs": {"a": 1}}
    with pytest.raises(ConfigError, match="`args.autoscaling`"):
        build_app({"autoscaling": {"policy": "no_such_module:policy"}})


def test_llm_router_hashes_blocks_as_the_engine_caches_them():
    """LLMRouter's kwargs get the engine's shape, and the simulated preset's step times."""
    cfg = load_config(
        {
            "engine": {"model": "sim:h100-llama3-8b", "block_size": 16, "max_num_seqs": 32},
            "router": {"request_router_class": "router:LLMRouter", "request_router_kwargs": {"load_bound": 1.5}},
        }
    )
    kwargs = llm_deployment_options(cfg)["request_router_config"].request_router_kwargs
    assert (kwargs["block_size"], kwargs["max_num_seqs"], kwargs["load_bound"]) == (16, 32, 1.5)
    assert kwargs["cost_model"] == "h100-llama3-8b"
    cpu = llm_deployment_options(load_config({"router": {"request_router_class": "router:LLMRouter"}}))
    assert cpu["request_router_config"].request_router_kwargs["cost_model"] == "cpu-smollm2"
    # device auto on replicas that reserve a GPU: they will run on it, whatever the deploying node has
    gpu = llm_deployment_options(
        load_config({"replica": {"num_gpus": 1}, "router": {"request_router_class": "router:LLMRouter"}})
    )
    assert gpu["request_router_config"].request_router_kwargs["cost_model"] == "h100-llama3-8b"


@pytest.mark.parametrize(
    "router,stride",
    [
        ({"request_router_class": "router:LLMRouter"}, 4),  # 32 tokens of 8-token blocks
        ({"request_router_class": "router:LLMRouter", "request_router_kwargs": {"index_stride_tokens": 16}}, 2),
        ({"request_router_class": "router:LLMRouter", "request_router_kwargs": {"index_stride_tokens": 5}}, 1),
        ({}, 1),  # Serve's router reads no evictions: every block, as the engine logs them
    ],
)
def test_the_replicas_report_the_evicted_blocks_the_routers_index_keeps(router, stride):
    """The LLM replicas log one evicted block of a chain in LLMRouter's index stride (its
    `index_stride_blocks`), so a report names only blocks the routers' indexes hold."""
    llm = build_app({"router": router})._bound_deployment.init_args[0]._bound_deployment
    assert llm.init_args[4] == stride


def test_with_a_router_of_its_own_the_ingress_routes_on_its_event_loop():
    """LLMRouter's decisions are CPU work: they run on the ingress's loop, not in a thread of their own
    contending for the GIL with it (docs/routing.md); Serve's own router keeps Serve's default."""

    def ingress_env(args):
        options = build_app(args)._bound_deployment.ray_actor_options
        return options.get("runtime_env", {}).get("env_vars", {})

    assert ingress_env({"router": {"request_router_class": "router:LLMRouter"}}) == {
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"
    }
    assert "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP" not in ingress_env({})


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_serve_configs_build_their_app(name):
    """What `serve run` / `serve deploy` does with the file, short of starting replicas: Serve's schema,
    then the import path called with the args (AppConfig, Serve's router and autoscaling configs)."""
    raw = yaml.safe_load((ROOT / name).read_text())
    (app,) = ServeDeploySchema.model_validate(raw).applications
    module, _, attr = app.import_path.partition(":")
    built = getattr(importlib.import_module(module), attr)(app.args)
    assert isinstance(built, Application)
