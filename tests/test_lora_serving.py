"""Multi-LoRA serving through real Serve: adapter names, /v1/models, the load/unload endpoints, the
router sending an adapter's requests to the replica holding it (simulated replicas: adapters are
bookkeeping there), and a real PEFT adapter on tiny-llama changing the answer."""

from __future__ import annotations

import httpx
import pytest
from conftest import TINY, tiny_config

SIM = "sim:cpu-smollm2"
REPLICA = "X-Iterserve-Replica"


def sim_config(replicas: int, lora: dict, router_class=None) -> dict:
    router = {"request_routing_stats_period_s": 0.2}
    if router_class:
        router["request_router_class"] = router_class
    return {
        "engine": {"model": SIM, "num_kv_blocks": 256, "block_size": 8, "max_num_seqs": 16, "lora": lora},
        "replica": {"num_replicas": replicas},
        "stream": {"interval_ms": 10},
        "router": router,
    }


def chat(url: str, model=None, text="Hello there", max_tokens=4, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def dynamic_app(serve_cluster, tmp_path_factory):
    """Two simulated replicas, LLMRouter, adapters found on first use in a dynamic loading path."""
    root = tmp_path_factory.mktemp("adapters")
    yield serve_cluster.deploy(
        "loradyn", sim_config(2, {"max_loras": 2, "dynamic_lora_loading_path": str(root)}, "router:LLMRouter")
    )
    serve_cluster.delete("loradyn")


@pytest.fixture(scope="module")
def static_app(serve_cluster):
    """One simulated replica; one configured adapter and no dynamic path: the ingress knows every name."""
    yield serve_cluster.deploy("lorastatic", sim_config(1, {"max_loras": 2, "adapters": {"fixed": "/adapters/fixed"}}))
    serve_cluster.delete("lorastatic")


@pytest.mark.slow
def test_an_adapters_requests_go_to_the_replica_holding_it(dynamic_app):
    first = chat(dynamic_app, "alpha")
    assert first.status_code == 200, first.text
    holder = first.headers[REPLICA]
    replicas = {holder}
    for i in range(8):
        r = chat(dynamic_app, "alpha", text=f"question {i}")
        assert r.status_code == 200 and r.json()["model"] == "alpha"
        replicas.add(r.headers[REPLICA])
    assert replicas == {holder}
    # base:adapter is the same adapter (Ray Serve LLM's form).
    base = httpx.get(f"{dynamic_app}/v1/models", timeout=30).json()["data"][0]["id"]
    r = chat(dynamic_app, f"{base}:alpha")
    assert r.status_code == 200 and r.headers[REPLICA] == holder
    # A Python handle names it the same way.
    from ray import serve

    from deployments.protocol import GenerateRequest

    out = (
        serve.get_app_handle("loradyn")
        .generate.remote(GenerateRequest(prompt="hi", max_tokens=2, model="alpha"))
        .result()
    )
    assert out.replica_id == holder


@pytest.mark.slow
def test_models_lists_the_adapters_replicas_hold_with_their_parent(dynamic_app):
    assert chat(dynamic_app, "beta").status_code == 200
    data = httpx.get(f"{dynamic_app}/v1/models", timeout=30).json()["data"]
    base = data[0]
    assert base["parent"] is None and base["root"] == base["id"]
    cards = {c["id"]: c for c in data[1:]}
    assert "beta" in cards and cards["beta"]["parent"] == base["id"] and cards["beta"]["object"] == "model"


def test_unknown_names_are_404_when_the_ingress_knows_every_adapter(static_app):
    for name in ("nope", "other-base:fixed", "nope:"):
        r = chat(static_app, name)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert chat(static_app, "fixed").status_code == 200
    ids = [c["id"] for c in httpx.get(f"{static_app}/v1/models", timeout=30).json()["data"]]
    assert "fixed" in ids


def test_load_then_unload_an_adapter(static_app):
    assert chat(static_app, "added").status_code == 404
    r = httpx.post(
        f"{static_app}/v1/load_lora_adapter", json={"lora_name": "added", "lora_path": "/adapters/a"}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert chat(static_app, "added").status_code == 200
    assert "added" in [c["id"] for c in httpx.get(f"{static_app}/v1/models", timeout=30).json()["data"]]
    r = httpx.post(f"{static_app}/v1/unload_lora_adapter", json={"lora_name": "added"}, timeout=30)
    assert r.status_code == 200, r.text
    assert chat(static_app, "added").status_code == 404
    assert "added" not in [c["id"] for c in httpx.get(f"{static_app}/v1/models", timeout=30).json()["data"]]
    assert (
        httpx.post(f"{static_app}/v1/unload_lora_adapter", json={"lora_name": "added"}, timeout=30).status_code == 404
    )
    bad = httpx.post(f"{static_app}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"


# ---- a real adapter: tiny-llama ----------------------------------------------------------------------


def _peft_adapter(model, directory) -> str:
    from peft import LoraConfig, get_peft_model

    get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tiny_lora(serve_cluster, tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from batcher.model_loader import load_model

    root = tmp_path_factory.mktemp("tiny-adapters")
    torch.manual_seed(0)
    good = _peft_adapter(load_model(TINY, torch.float32, torch.device("cpu"))[0], root / "good")
    other = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=128,
        )
    )
    wrong_shape = _peft_adapter(other, root / "wrong-shape")
    (root / "empty").mkdir()
    config = tiny_config()
    config["engine"]["lora"] = {"max_loras": 2}
    url = serve_cluster.deploy("loratiny", config)
    yield url, {"good": good, "wrong-shape": wrong_shape, "empty": str(root / "empty")}
    serve_cluster.delete("loratiny")


def test_a_peft_adapter_loaded_through_the_endpoint_changes_the_answer(tiny_lora):
    url, paths = tiny_lora
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": paths["good"]}, timeout=60)
    assert r.status_code == 200, r.text
    base = chat(url, None, max_tokens=8, ignore_eos=True)
    tuned = chat(url, "good", max_tokens=8, ignore_eos=True)
    assert base.status_code == tuned.status_code == 200, tuned.text
    assert tuned.json()["choices"][0]["message"]["content"] != base.json()["choices"][0]["message"]["content"]
    assert tuned.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("name", ["empty", "wrong-shape"])
def test_bad_adapters_are_refused_at_load_with_400(tiny_lora, name):
    url, paths = tiny_lora
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": paths[name]}, timeout=60)
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"]
    assert chat(url, name).status_code == 404  # never registered
    assert chat(url, None).status_code == 200  # the replica serves on
