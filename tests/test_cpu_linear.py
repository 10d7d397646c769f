"""The CPU GEMM layout the model runner switches linears to: same results as F.linear, same parameters."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from batcher.cpu_linear import MAX_ROWS, WeightMajorLinear, use_weight_major_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 7), (3, 5), (1, 64), (1, MAX_ROWS), (1, MAX_ROWS + 1)])
def test_matches_f_linear_at_every_row_count(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 160, bias=bias)
    x = torch.randn(*shape, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.__class__ = WeightMajorLinear
    got = layer(x)
    assert got.shape == expected.shape == (*shape, 160)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_switches_every_linear_and_keeps_tied_weights():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.inference_mode():
        before = model(ids).logits
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert use_weight_major_linears(model) == len(linears) == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert all(type(m) is WeightMajorLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert use_weight_major_linears(model) == 0  # already switched
