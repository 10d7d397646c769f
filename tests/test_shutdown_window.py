"""The graceful shutdown window: sized from the model's context length, decided in one place (the
engine and the deploy read the same value from the model's config), and kept by the ingress too."""

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from batcher import EngineConfig, LLMEngine
from batcher.model_files import load_tokenizer
from deployments.app import ConfigError, build_app, llm_deployment_options, load_config
from deployments.shutdown import model_len


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """A local Mistral-family model whose sliding window (256) is shorter than its positions (4096)."""
    path = tmp_path_factory.mktemp("windowed")
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(path)
    return str(path)


def test_the_deploy_sizes_the_shutdown_window_from_the_engines_context_length(windowed_model):
    engine = LLMEngine(EngineConfig(model=windowed_model, num_kv_blocks=64))
    assert engine.max_model_len == 256
    assert model_len(EngineConfig(model=windowed_model)) == 256
    options = llm_deployment_options(
        load_config({"engine": {"model": windowed_model}, "replica": {"shutdown_token_s": 1.0}})
    )
    assert options["graceful_shutdown_timeout_s"] == 256 + 2 * 2  # 256 tokens at 1 s, plus two checks


def test_a_max_model_len_beyond_the_model_fails_the_deploy(windowed_model):
    with pytest.raises(ConfigError, match="max_model_len 1024 exceeds what the model supports \\(256\\)"):
        llm_deployment_options(load_config({"engine": {"model": windowed_model, "max_model_len": 1024}}))


def test_graceful_window_sized_from_max_model_len():
    short = llm_deployment_options(load_config({"engine": {"model": "sim:cpu-smollm2", "max_model_len": 512}}))
    long = llm_deployment_options(load_config({"engine": {"model": "sim:cpu-smollm2", "max_model_len": 2048}}))
    assert long["graceful_shutdown_timeout_s"] > 3 * short["graceful_shutdown_timeout_s"]
    fixed = llm_deployment_options(load_config({"replica": {"graceful_shutdown_timeout_s": 7}}))
    assert fixed["graceful_shutdown_timeout_s"] == 7


def test_ingress_waits_as_long_as_the_llm_replicas():
    """A redeploy replaces the ingress too; it relays the streams, so it keeps the LLM's window and
    its checks (Serve's default, 20 s, would cut longer streams)."""
    ingress = build_app(
        {
            "engine": {"model": "sim:cpu-smollm2"},
            "replica": {"graceful_shutdown_timeout_s": 90, "graceful_shutdown_wait_loop_s": 3},
        }
    )
    llm = ingress._bound_deployment.init_args[0]._bound_deployment
    for d in (ingress._bound_deployment, llm):
        assert d._deployment_config.graceful_shutdown_timeout_s == 90
        assert d._deployment_config.graceful_shutdown_wait_loop_s == 3
