"""Pre-packed oneDNN linear layers: which layers convert, tied weights kept, values as F.linear's, bad input named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import medusa_train.loading.cpu_kernels as cpu_kernels
from medusa_train.loading.cpu_kernels import (
    PackedKernels,
    PackedLinear,
    apply_cpu_kernels,
    choose_cpu_kernels,
    measure_one_row_kernels,
    onednn_available,
    pack_linear_layers,
    use_one_row_kernel,
)
from tests.conftest import BF16, NEEDS_BF16_PACKING, make_tiny_model

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


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
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


@pytest.mark.parametrize("dtype, gemv", [(torch.float32, True), pytest.param(torch.bfloat16, False,
                                                                             marks=NEEDS_BF16_PACKING, id="bf16")])
def test_fp32_keeps_one_row_on_pytorchs_gemv_until_chosen_and_bf16_packs_every_row_count(dtype, gemv):
    torch.manual_seed(0)
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
    bf16 = "onednn_packed" if cpu_kernels.onednn_packs(torch.bfloat16) else "pytorch"
    assert choose_cpu_kernels("auto", "cpu", torch.bfloat16).kernels == bf16
    assert choose_cpu_kernels(None, "cpu", torch.float32).kernels == "onednn_packed"
    assert choose_cpu_kernels("none", "cpu", torch.float32).kernels == "pytorch"
    auto_gpu = choose_cpu_kernels("auto", "cuda", torch.bfloat16)
    assert auto_gpu.kernels == "pytorch" and "not the CPU" in auto_gpu.reason
    with pytest.raises(ValueError, match="cpu_kernels=packed: the model runs on cuda"):
        choose_cpu_kernels("packed", "cuda:0", torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, packed, none"):
        choose_cpu_kernels("fast", "cpu", torch.float32)
    model = make_tiny_model("llama").requires_grad_(False)
    assert apply_cpu_kernels(model, choose_cpu_kernels("none", "cpu", torch.float32)) == PackedKernels()
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_one_row_on_onednn_releases_the_plain_weights_and_multiplies_on_the_packed_ones():
    model = make_tiny_model("llama").requires_grad_(False)
    pack_linear_layers(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.row_weight is not None for m in layers)  # fp32: both kernels available until the choice
    use_one_row_kernel(model, "pytorch_gemv")
    assert all(m.row_weight is not None for m in layers)
    use_one_row_kernel(model, "onednn")
    assert all(m.row_weight is None for m in layers)
    layer, row = layers[0], torch.randn(1, 1, layers[0].in_features)
    assert torch.equal(layer(row), torch.ops.mkldnn._linear_pointwise(row, layer.packed_weight, layer.bias, "none",
                                                                       [], ""))
    with pytest.raises(ValueError, match="one-row kernel must be pytorch_gemv or onednn, got 'mkl'"):
        use_one_row_kernel(model, "mkl")


def test_the_measurement_times_both_kernels_and_leaves_the_layers_as_they_were():
    model = make_tiny_model("llama").requires_grad_(False)
    pack_linear_layers(model)
    plain = [m.row_weight for m in model.modules() if isinstance(m, PackedLinear)]
    timed = measure_one_row_kernels(model, repeats=2)
    assert set(timed) == {"pytorch_gemv", "onednn"} and all(ms > 0 for ms in timed.values())
    assert [m.row_weight for m in model.modules() if isinstance(m, PackedLinear)] == plain
    use_one_row_kernel(model, "onednn")  # chosen: nothing left to time, named rather than an IndexError
    with pytest.raises(ValueError, match="needs an fp32 model packed by pack_linear_layers .* this one has none"):
        measure_one_row_kernels(model)
    with pytest.raises(ValueError, match="this one has none"):
        measure_one_row_kernels(make_tiny_model("llama"))


@pytest.mark.parametrize("gemv_ms, onednn_ms, kept", [(2.0, 1.0, "onednn"), (1.0, 2.0, "pytorch_gemv"),
                                                       (1.0, 1.0, "pytorch_gemv")])
def test_fp32_keeps_the_one_row_kernel_measured_faster(monkeypatch, gemv_ms, onednn_ms, kept):
    monkeypatch.setattr(cpu_kernels, "measure_one_row_kernels",
                        lambda model: {"pytorch_gemv": gemv_ms, "onednn": onednn_ms})
    model = make_tiny_model("llama").requires_grad_(False)
    applied = apply_cpu_kernels(model, choose_cpu_kernels("packed", "cpu", torch.float32))
    assert applied == PackedKernels(15, kept, {"pytorch_gemv": gemv_ms, "onednn": onednn_ms})
    rows = [m.row_weight is not None for m in model.modules() if isinstance(m, PackedLinear)]
    assert rows == [kept == "pytorch_gemv"] * 15
    assert applied.record()["one_row"] == kept
    assert f"one row on {kept}" in applied.describe()


def test_bf16_on_a_cpu_onednn_cannot_pack_it_for_runs_unpacked_and_packed_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "onednn_packs", lambda dtype: dtype != torch.bfloat16)
    auto = choose_cpu_kernels("auto", "cpu", torch.bfloat16)
    assert auto.kernels == "pytorch" and "oneDNN cannot pack torch.bfloat16 weights on this CPU" in auto.reason
    with pytest.raises(ValueError, match="cpu_kernels=packed: oneDNN cannot pack torch.bfloat16 weights on this CPU "
                                         r"\(its bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT\); use "
                                         "cpu_kernels=auto or none"):
        choose_cpu_kernels("packed", "cpu", torch.bfloat16)
    assert choose_cpu_kernels("auto", "cpu", torch.float32).kernels == "onednn_packed"


@NEEDS_BF16_PACKING
def test_bf16_measures_nothing_it_packs_every_row_count(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "measure_one_row_kernels", lambda model: pytest.fail("measured bf16"))
    model = make_tiny_model("llama").to(torch.bfloat16).requires_grad_(False)
    applied = apply_cpu_kernels(model, choose_cpu_kernels("packed", "cpu", torch.bfloat16))
    assert applied == PackedKernels(15) and applied.record() == {"packed_layers": 15, "one_row": None,
                                                                  "one_row_ms": {}}
