"""The real-cluster manifests: the Ray cluster launcher YAML against Ray's own schema and checks, the
KubeRay RayService's embedded serve config against Serve's schema, serve_config.gpu.yaml and the
app builder. Neither has run on a cloud or Kubernetes (no GPUs, no network here); the KubeRay CRD
schema is not at hand."""

from __future__ import annotations

import importlib
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import validate_config
from ray.serve.schema import ServeDeploySchema

from deployments.app import load_config

ROOT = Path(__file__).resolve().parent.parent


def _gpu_serve_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())


def test_cluster_launcher_yaml_passes_rays_schema_and_checks():
    config = yaml.safe_load((ROOT / "cluster" / "ray-cluster.gpu.yaml").read_text())
    validate_config(config)  # ray-schema.json (jsonschema) + the launcher's own consistency checks
    gpu = config["available_node_types"]["gpu_worker"]
    head = config["available_node_types"][config["head_node_type"]]
    replica = load_config(_gpu_serve_config()["applications"][0]["args"])
    # A GPU worker fits a replica; the head cannot hold one (replicas go to the workers it scales).
    assert gpu["resources"]["GPU"] >= replica.replica.num_gpus > head["resources"].get("GPU", 0)
    # The GPU workers can hold every replica the policy may ask for.
    per_worker = gpu["resources"]["GPU"] // replica.replica.num_gpus
    assert gpu["max_workers"] * per_worker >= replica.autoscaling.max_replicas


def test_cluster_launcher_schema_rejects_a_typo():
    config = yaml.safe_load((ROOT / "cluster" / "ray-cluster.gpu.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)


def test_rayservice_embeds_exactly_the_gpu_serve_config_and_it_builds():
    doc = yaml.safe_load((ROOT / "cluster" / "rayservice.gpu.yaml").read_text())
    serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
    assert serve == _gpu_serve_config()  # one config, two places: a change to one must reach the other
    (app,) = ServeDeploySchema.model_validate(serve).applications
    # What Serve does with it: import the builder and call it with the args (validated there).
    module, _, name = app.import_path.partition(":")
    getattr(importlib.import_module(module), name)(app.args)
    cfg = load_config(app.args)
    cluster = doc["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    # A worker pod fits a replica; the head takes none (no GPU there, and no CPU for Ray to place on).
    assert int(limits["nvidia.com/gpu"]) >= cfg.replica.num_gpus > 0
    assert "nvidia.com/gpu" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"]) < cfg.replica.num_cpus
    # The worker group can follow the policy's whole range.
    assert group["maxReplicas"] >= cfg.autoscaling.max_replicas and group["minReplicas"] <= cfg.autoscaling.min_replicas
