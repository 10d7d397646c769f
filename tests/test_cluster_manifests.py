"""The real-cluster manifests: the Ray cluster launcher YAML against Ray's own schema and checks, the
KubeRay RayService's embedded serve config against Serve's schema and AppConfig. Neither has run on
a cloud or Kubernetes (no GPUs, no network here); the KubeRay CRD schema is not at hand."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import validate_config
from ray.serve.schema import ServeDeploySchema

from deployments.app import llm_deployment_options, load_config
from deployments.autoscaling import POLICY_PATH

ROOT = Path(__file__).resolve().parent.parent


def _gpu_app_args() -> dict:
    return yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())["applications"][0]["args"]


def test_cluster_launcher_yaml_passes_rays_schema_and_checks():
    config = yaml.safe_load((ROOT / "cluster" / "ray-cluster.gpu.yaml").read_text())
    validate_config(config)  # ray-schema.json (jsonschema) + the launcher's own consistency checks
    gpu = config["available_node_types"]["gpu_worker"]
    head = config["available_node_types"][config["head_node_type"]]
    assert gpu["resources"]["GPU"] == 1 and head["resources"]["GPU"] == 0
    # The GPU workers can hold every replica the policy may ask for, one GPU each.
    args = _gpu_app_args()
    assert gpu["max_workers"] * gpu["resources"]["GPU"] >= args["autoscaling"]["max_replicas"] * args["replica"]["num_gpus"]
    assert any("--autoscaling-config" in c for c in config["head_start_ray_commands"])


def test_cluster_launcher_schema_rejects_a_typo():
    config = yaml.safe_load((ROOT / "cluster" / "ray-cluster.gpu.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)


def test_rayservice_embeds_the_gpu_serve_config():
    doc = yaml.safe_load((ROOT / "cluster" / "rayservice.gpu.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = ServeDeploySchema.model_validate(serve).applications
    cfg = load_config(app.args)
    opts = llm_deployment_options(cfg)  # the options Serve would get: autoscaling validated by Serve
    assert opts["autoscaling_config"]["policy"]["policy_function"] == POLICY_PATH  # the queue-depth policy
    gpu_args = _gpu_app_args()
    for section in ("engine", "replica", "autoscaling"):
        assert app.args[section] == gpu_args[section], section
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == cfg.replica.num_gpus == 1
    assert group["maxReplicas"] >= cfg.autoscaling.max_replicas and group["minReplicas"] <= cfg.autoscaling.min_replicas
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
