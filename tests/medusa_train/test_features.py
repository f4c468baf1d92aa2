"""The target's named features (medusa_train.models.features): one layer indexing for training, tuning and decoding, checked
against the base model's own ``output_hidden_states`` on every tiny family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_train.models.features import (
    FINAL,
    check_feature_layers,
    count_layers,
    default_eagle3_layers,
    feature_layer,
    layer_feature,
    target_features,
)
from medusa_train.training.step import FrozenBase
from tests.conftest import VOCAB, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a right-padded row
    return ids, mask


def _decoder_layers(backbone: nn.Module, num_layers: int) -> nn.ModuleList:
    lists = [m for m in backbone.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    assert len(lists) == 1, [type(m[0]).__name__ for m in lists]
    return lists[0]


@torch.no_grad()
def test_every_layer_feature_is_output_hidden_states_and_the_input_of_its_layer(family):
    model = make_tiny_model(family)
    ids, mask = _inputs()
    L = count_layers(model.config)
    assert L == 2
    reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)  # the *ForCausalLM's own
    inputs: dict[int, torch.Tensor] = {}

    def record(i):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).clone()
        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True)
               for i, layer in enumerate(_decoder_layers(model.base_model, L))]
    try:
        features, _ = target_features(model.base_model, ids, range(L + 1), attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(features) == sorted([FINAL] + [f"layer{i}" for i in range(L + 1)])
    assert len(reference.hidden_states) == L + 1
    for i in range(L + 1):
        assert features[layer_feature(i)].dtype == torch.float32
        assert torch.equal(features[layer_feature(i)], reference.hidden_states[i]), i
    for i in range(L):  # layer{i} is what decoder layer i reads
        assert torch.equal(features[layer_feature(i)], inputs[i]), i
    last = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(features[FINAL], last)
    assert torch.equal(features[layer_feature(L)], last)  # transformers' index L: after the final norm
    assert torch.equal(model.get_output_embeddings()(features[FINAL]), reference.logits)
    alone, _ = target_features(model.base_model, ids, attention_mask=mask)
    assert list(alone) == [FINAL] and torch.equal(alone[FINAL], last)


class Recording(nn.Module):
    """A backbone that records the keyword arguments of each call."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, []

    def forward(self, **kwargs):
        self.calls.append(set(kwargs))
        return self.inner(**kwargs)


@torch.no_grad()
def test_without_layers_the_backbone_is_not_asked_for_its_hidden_states(tiny_llama):
    ids, mask = _inputs()
    spy = Recording(tiny_llama.base_model)
    features, cache = target_features(spy, ids, attention_mask=mask, use_cache=True)
    assert spy.calls == [{"input_ids", "attention_mask", "use_cache", "return_dict"}]
    assert cache is not None and cache.get_seq_length() == 9
    hidden = FrozenBase(backbone=spy, lm_head=tiny_llama.get_output_embeddings()).hidden(ids, mask)
    assert spy.calls[1] == {"input_ids", "attention_mask", "use_cache", "return_dict"}
    assert torch.equal(hidden, features[FINAL])
    target_features(spy, ids, [1], attention_mask=mask)
    assert "output_hidden_states" in spy.calls[2]


def test_layer_indices_out_of_range_are_refused_naming_the_field(tiny_llama):
    assert check_feature_layers([0, 2, 1], 2) == (0, 2, 1)
    with pytest.raises(ValueError, match=r"heads\.feature_layers: layer 3 is out of range for a target with 2 layers;"
                                         r" give indices 0\.\.2"):
        check_feature_layers([1, 3], 2)
    with pytest.raises(ValueError, match=r"draft\.layers: layer -1 is out of range"):
        check_feature_layers([-1], 2, field="draft.layers")
    with pytest.raises(ValueError, match=r"heads\.feature_layers: layer 1 is given twice"):
        check_feature_layers([1, 1], 2)
    with pytest.raises(ValueError, match=r"heads\.feature_layers: layer index '1' is not an integer"):
        check_feature_layers(["1"], 2)
    ids, mask = _inputs()
    with pytest.raises(ValueError, match=r"layers: layer 3 is out of range for a target with 2 layers"):
        target_features(tiny_llama.base_model, ids, [3], attention_mask=mask)


def test_feature_names():
    assert layer_feature(7) == "layer7" and feature_layer("layer7") == 7 and feature_layer(FINAL) is None
    for bad in ("hidden", "layer", "layer-1", "Layer2"):
        with pytest.raises(ValueError, match=rf"unknown target feature '{bad}': use 'final'"):
            feature_layer(bad)


def test_the_layer_count_of_each_family(family):
    assert count_layers(make_tiny_model(family, num_hidden_layers=3).config) == 3


@pytest.mark.parametrize("num_layers, taps", [(7, (2, 3, 4)), (16, (2, 8, 13)), (28, (2, 14, 25)),
                                              (32, (2, 16, 29)), (80, (2, 40, 77))])
def test_default_eagle3_layers_are_vllms(num_layers, taps):
    # vLLM 0.32.0, SupportsEagle3.get_eagle3_default_aux_hidden_state_layers: (2, L // 2, L - 3)
    assert default_eagle3_layers(num_layers) == taps
    assert check_feature_layers(taps, num_layers) == taps


def test_default_eagle3_layers_refuse_a_target_too_shallow_for_three_taps():
    with pytest.raises(ValueError, match=r"\(2, 3, 3\) are not three distinct layers of a target with L = 6 layers"):
        default_eagle3_layers(6)
