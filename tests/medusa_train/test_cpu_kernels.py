"""Pre-packed oneDNN linear layers: which layers convert, tied weights kept, values as F.linear's, bad input named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_train.loading.cpu_kernels import (
    PackedLinear,
    apply_cpu_kernels,
    choose_cpu_kernels,
    onednn_available,
    pack_linear_layers,
)
from tests.conftest import make_tiny_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")]


@pytest.mark.parametrize("family, linears", [("llama", 2 * 7 + 1), ("gpt2", 2 * 4 + 1), ("gpt_neox", 2 * 4 + 1)])
def test_every_linear_layer_is_packed_and_the_tied_lm_head_keeps_the_embedding(family, linears):
    model = make_tiny_model(family).requires_grad_(False)
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    assert pack_linear_layers(model) == linears
    assert not any(type(m) is nn.Linear for m in model.modules())
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.weight is model.get_output_embeddings().weight
    assert (head.weight is embedding) == tied  # the embedding still looks tokens up in the same parameter
    others = [m for m in model.modules() if isinstance(m, PackedLinear) and m is not head]
    assert others and all(m.weight is None for m in others)  # the original weights are released


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_logits_are_those_of_pytorchs_kernels(family, dtype):
    plain = make_tiny_model(family).to(dtype).requires_grad_(False)
    packed = make_tiny_model(family).to(dtype).requires_grad_(False)
    pack_linear_layers(packed)
    ids = torch.tensor([[1, 5, 9, 33, 20, 7]])
    a, b = plain(ids).logits.float(), packed(ids).logits.float()
    if dtype == torch.bfloat16:
        assert torch.equal(a, b)  # PyTorch's bf16 F.linear is oneDNN's GEMM too
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # MKL's and oneDNN's fp32 GEMMs round differently


def test_fp32_keeps_one_row_on_pytorchs_gemv_and_bf16_packs_every_row_count():
    torch.manual_seed(0)
    for dtype, gemv in ((torch.float32, True), (torch.bfloat16, False)):
        linear = nn.Linear(64, 48).to(dtype).requires_grad_(False)
        layer = PackedLinear.from_module(linear)
        assert (layer.row_weight is not None) == gemv
        one, many = torch.randn(1, 1, 64, dtype=dtype), torch.randn(1, 5, 64, dtype=dtype)
        if gemv:
            assert torch.equal(layer(one), torch.nn.functional.linear(one, linear.weight, linear.bias))
        packed = torch.ops.mkldnn._linear_pointwise(many, layer.packed_weight, linear.bias, "none", [], "")
        assert torch.equal(layer(many), packed)


def test_a_packed_layer_refuses_other_inputs_and_training():
    layer = PackedLinear.from_module(nn.Linear(8, 4))
    with pytest.raises(TypeError, match="holds torch.float32 weights, got a torch.bfloat16 input"):
        layer(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D CPU float32/bfloat16 weight"):
        PackedLinear(torch.zeros(4, 8, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="packing is for inference"):
        pack_linear_layers(nn.Sequential(nn.Linear(8, 4)))  # requires_grad left on


def test_the_choice_of_kernels():
    assert choose_cpu_kernels("auto", "cpu", torch.bfloat16).kernels == "onednn_packed"
    assert choose_cpu_kernels(None, "cpu", torch.float32).kernels == "onednn_packed"
    assert choose_cpu_kernels("none", "cpu", torch.float32).kernels == "pytorch"
    auto_gpu = choose_cpu_kernels("auto", "cuda", torch.bfloat16)
    assert auto_gpu.kernels == "pytorch" and "not the CPU" in auto_gpu.reason
    with pytest.raises(ValueError, match="cpu_kernels=packed: the model runs on cuda"):
        choose_cpu_kernels("packed", "cuda:0", torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, packed, none"):
        choose_cpu_kernels("fast", "cpu", torch.float32)
    model = make_tiny_model("llama").requires_grad_(False)
    assert apply_cpu_kernels(model, choose_cpu_kernels("none", "cpu", torch.float32)) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
