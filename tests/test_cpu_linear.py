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
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
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


# ---- the C++ kernel for bf16 and int8 weights (batcher/native/linear.cpp) ------------------------


def _kernel():
    from batcher.cpu_linear import linear_kernel_available

    if not linear_kernel_available():
        pytest.skip("this CPU has no AVX512_BF16 (or no compiler): the kernel is not used here")
    return torch.ops.iterserve_cpu


def _rounded(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """The product of bf16 values in float64, rounded once to bf16: what the kernel approximates."""
    y = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    return y.to(torch.bfloat16)


def _assert_within_bf16_rounding(got: torch.Tensor, expected: torch.Tensor):
    # fp32 accumulation in another order than float64's: at most one bf16 step (2^-7 relative) apart
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    step = expected.float().abs().clamp(min=1e-2) * 2**-7
    assert ((got.float() - expected.float()).abs() <= step * 1.01).all()


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [64, 96, 576])
def test_bf16_kernel_is_the_product_rounded_once(rows, bias, in_features):
    ops = _kernel()
    torch.manual_seed(rows)
    w = (torch.randn(200, in_features) * 0.1).to(torch.bfloat16)
    b = torch.randn(200).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    _assert_within_bf16_rounding(ops.linear(x, w, b), _rounded(x, w, b))


def test_bf16_kernel_hands_what_it_does_not_take_to_f_linear_exactly():
    ops = _kernel()
    torch.manual_seed(0)
    w = torch.randn(48, 96).to(torch.bfloat16)
    cases = [
        torch.randn(17, 96).to(torch.bfloat16),  # more rows than the kernel takes
        torch.randn(2, 3, 96).to(torch.bfloat16)[:, :, :],  # 6 rows in a 3-d batch: the kernel (checked below)
    ]
    assert torch.equal(ops.linear(cases[0], w), F.linear(cases[0], w))
    _assert_within_bf16_rounding(ops.linear(cases[1], w), _rounded(cases[1].reshape(6, 96), w).reshape(2, 3, 48))
    odd = torch.randn(4, 100).to(torch.bfloat16)  # in_features not a multiple of 32
    w_odd = torch.randn(48, 100).to(torch.bfloat16)
    assert torch.equal(ops.linear(odd, w_odd), F.linear(odd, w_odd))
    x32, w32 = torch.randn(4, 96), torch.randn(48, 96)  # float32
    assert torch.equal(ops.linear(x32, w32), F.linear(x32, w32))
    wt = torch.randn(96, 48).to(torch.bfloat16).t()  # a transposed (non-contiguous) weight
    x = torch.randn(4, 96).to(torch.bfloat16)
    assert torch.equal(ops.linear(x, wt), F.linear(x, wt))


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 32, 33])
def test_int8_kernel_is_the_product_with_the_dequantized_weight(rows):
    from batcher.quantization import quantize_int8

    ops = _kernel()
    torch.manual_seed(rows)
    q, scales = quantize_int8(torch.randn(160, 576) * torch.logspace(-2, 0, 160)[:, None], torch.bfloat16)
    bias = torch.randn(160).to(torch.bfloat16)
    x = torch.randn(rows, 576).to(torch.bfloat16)
    got = ops.linear_int8(x, q, scales, bias)
    if rows <= 32:  # the kernel: int8 read as the bf16 values they are, the scale applied in float
        exact = x.double() @ q.double().t() * scales.double() + bias.double()
        _assert_within_bf16_rounding(got, exact.to(torch.bfloat16))
    else:  # the dense fallback, exactly the formula of batcher/quantization.py
        assert torch.equal(got, F.linear(x, q.to(torch.bfloat16)) * scales + bias)


def test_the_kernels_run_inside_a_compiled_graph_with_a_dynamic_row_count():
    from batcher.quantization import quantize_int8

    ops = _kernel()
    torch.manual_seed(0)
    w = (torch.randn(64, 96) * 0.1).to(torch.bfloat16)
    q, scales = quantize_int8(torch.randn(64, 64), torch.bfloat16)

    def two_layers(x):
        return ops.linear_int8(torch.relu(ops.linear(x, w)), q, scales)

    compiled = torch.compile(two_layers, fullgraph=True, dynamic=True)
    for rows in (2, 7, 16, 33):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        assert torch.equal(compiled(x), two_layers(x))


def test_a_bf16_model_switched_to_the_kernel_keeps_its_logits_and_tied_weights():
    from batcher.cpu_linear import BF16KernelLinear, use_kernel_linears

    _kernel()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.inference_mode():
        before = model(ids).logits
    assert use_kernel_linears(model) == 2 * 7 + 1
    assert all(type(m) is BF16KernelLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        after = model(ids).logits
    torch.testing.assert_close(after.float(), before.float(), rtol=0.05, atol=0.05)


def test_int8_layers_switch_to_the_kernel_and_a_tied_head_reads_the_bf16_embedding():
    from batcher.cpu_linear import use_kernel_linears
    from batcher.quantization import Int8WeightLinear, quantize_linears

    ops = _kernel()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    quantize_linears(model, torch.bfloat16)
    model.to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, Int8WeightLinear)]
    assert use_kernel_linears(model) == len(layers) == 2 * 7 + 1
    assert all(m.cpu_kernel for m in layers)
    x = torch.randn(3, 64).to(torch.bfloat16)
    embedding = model.get_input_embeddings().weight
    assert torch.equal(model.lm_head(x), ops.linear(x, embedding))  # the head keeps bf16 precision
    proj = model.model.layers[0].mlp.up_proj
    assert torch.equal(proj(x), ops.linear_int8(x, proj.qweight, proj.scales))
