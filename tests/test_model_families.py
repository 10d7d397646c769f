"""The paged runner plugs into unmodified HF models of several families, loaded from a local directory."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from batcher import EngineConfig, LLMEngine, SamplingParams
from batcher.model_files import load_tokenizer

SMALL = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "qwen2": Qwen2Config(**SMALL),  # q/k/v biases
    "mistral": MistralConfig(**SMALL, sliding_window=None),
    "llama-mha": LlamaConfig(**{**SMALL, "num_key_value_heads": 4}),  # no GQA
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_parity_from_a_local_directory(family, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family])
    model.save_pretrained(tmp_path)
    load_tokenizer("smollm2-135m-instruct").save_pretrained(tmp_path)
    prompts = [[11, 22, 33, 44, 55, 66, 77], list(range(300, 340)), [9, 8]]
    lengths = [12, 5, 20]
    model.eval()
    expected = [
        model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p, n in zip(prompts, lengths)
    ]
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    )
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    assert [o.token_ids for o in outs] == expected
    assert len(set(expected[0])) > 1  # the random model's output varies, so equality means something
