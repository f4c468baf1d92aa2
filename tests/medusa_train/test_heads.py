from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medusa_train.models.heads_base import HeadsSpec, build_token_map
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from tests.conftest import HIDDEN, VOCAB, make_tiny_model


def reference_head(x, weights, biases, lm_head):
    """Head k as the Medusa paper writes it, one block at a time: x <- x + SiLU(W x + b), then W_2 x."""
    for w, b in zip(weights, biases):
        x = x + F.silu(x @ w.T + b)
    return x @ lm_head.T


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_stacked_heads_equal_per_head_reference(share, num_layers):
    torch.manual_seed(0)
    K, H, V = 3, 16, 29
    heads = MedusaHeads(HeadsSpec(K, num_layers, H, V, share_lm_head=share))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    base_lm = torch.randn(V, H)
    hidden = torch.randn(2, 5, H)
    logits = heads(hidden, base_lm)
    assert logits.shape == (K, 2, 5, V)
    for k in range(K):
        lm = base_lm if share else heads.lm_head_weight[k]
        expected = reference_head(hidden, heads.block_weight[k], heads.block_bias[k], lm)
        torch.testing.assert_close(logits[k], expected, rtol=1e-5, atol=1e-5)


def test_fresh_heads_are_identity_and_copy_base_lm_head():
    base = make_tiny_model("llama")
    heads = new_heads_for(base, num_heads=4, num_layers=2)
    hidden = torch.randn(1, 7, HIDDEN)
    torch.testing.assert_close(heads.transform(hidden), hidden.expand(4, 1, 7, HIDDEN))
    base_logits = base.lm_head(hidden)
    for k in range(4):
        torch.testing.assert_close(heads(hidden)[k], base_logits)


def test_blocks_do_not_share_parameters():
    heads = MedusaHeads(HeadsSpec(3, 2, 8, 11))
    with torch.no_grad():
        heads.block_weight[0, 0].fill_(1.0)
    # Writing one block leaves every other block untouched (Medusa's list-multiplication bug shared them).
    others = heads.block_weight.flatten(0, 1)[1:]
    assert torch.count_nonzero(others) == 0
    assert heads.block_weight.grad is None


@pytest.mark.parametrize("field,kwargs", [
    ("num_heads", dict(num_heads=0, num_layers=1)),
    ("num_layers", dict(num_heads=2, num_layers=0)),
])
def test_bad_spec_names_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        HeadsSpec(hidden_size=8, vocab_size=10, **kwargs)


def test_token_map_reduces_vocab_and_maps_back():
    base = make_tiny_model("llama")
    counts = torch.zeros(VOCAB)
    counts[[5, 9, 40, 3]] = torch.tensor([10.0, 7.0, 3.0, 1.0])
    token_map = build_token_map(counts, 3)
    assert token_map.tolist() == [5, 9, 40]
    heads = new_heads_for(base, num_heads=2, token_map=token_map)
    hidden = torch.randn(1, 4, HIDDEN)
    logits = heads(hidden)
    assert logits.shape == (2, 1, 4, 3)
    # Fresh heads: the reduced logits are the base logits restricted to the token map.
    torch.testing.assert_close(logits[0], base.lm_head(hidden)[..., token_map])
    assert heads.to_base_tokens(torch.tensor([2, 0])).tolist() == [40, 5]


def test_model_forward_all_families(family):
    base = make_tiny_model(family)
    model = SpeculativeModel(base, new_heads_for(base, num_heads=3))
    ids = torch.randint(3, VOCAB, (2, 6))
    out = model(ids)
    assert out.logits.shape == (2, 6, VOCAB)
    assert out.head_logits.shape == (3, 2, 6, VOCAB)
    # Base logits are exactly what the base model gives on its own.
    torch.testing.assert_close(out.logits, base(ids).logits, rtol=1e-5, atol=1e-5)


def test_heads_for_other_base_are_refused():
    base = make_tiny_model("llama")
    other = make_tiny_model("llama", vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        SpeculativeModel(base, new_heads_for(other, num_heads=2))
    wide = make_tiny_model("llama", hidden_size=HIDDEN * 2, head_dim=8)
    with pytest.raises(ValueError, match="hidden_size"):
        SpeculativeModel(base, new_heads_for(wide, num_heads=2))


@pytest.mark.parametrize("share", [False, True])
def test_the_first_heads_alone_equal_all_heads_cut(share):
    base = make_tiny_model("llama")
    heads = new_heads_for(base, num_heads=4, num_layers=2, share_lm_head=share)
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    model = SpeculativeModel(base, heads)
    hidden = torch.randn(2, 3, HIDDEN)
    full = model.head_logits(hidden)
    assert full.shape == (4, 2, 3, VOCAB)
    for k in (1, 2, 4):  # one head's product may run on another kernel than K's batched one: 1 ulp on AVX2 CPUs
        torch.testing.assert_close(model.head_logits(hidden, num_heads=k), full[:k], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"num_heads must be in \[1, 4\]"):
        model.head_logits(hidden, num_heads=5)

