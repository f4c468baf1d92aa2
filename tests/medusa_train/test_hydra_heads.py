"""Hydra heads: the paper's per-head function by hand, the path each head reads, teacher forcing against one level at a
time, fresh heads, and settings refused before any model loads."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from medusa_train.models.catalog import drafter_types, head_types, titles
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.models.catalog import shifted_path_tokens
from medusa_train.drafters.hydra.heads import HydraHeads, HydraSpec
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from medusa_train.training.recipe import build_recipe
from tests.conftest import HIDDEN, VOCAB, make_tiny_model
from tests.medusa_train.test_training import compose_train, tiny_overrides


def randomised(heads: torch.nn.Module, scale: float = 0.3, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return heads


def reference_head(heads: HydraHeads, k: int, hidden: torch.Tensor, embeds: list[torch.Tensor],
                   lm_head: torch.Tensor) -> torch.Tensor:
    """Head k written out: concat -> R x + SiLU(W x + b) -> x + SiLU(W x + b) ... -> projection (or sum first)."""
    head = heads.heads[k]
    if heads.spec.combine == "concat":
        x = torch.cat([hidden, *embeds], dim=-1)
        x = x @ head.residual.weight.T + F.silu(x @ head.layers[0].weight.T + head.layers[0].bias)
    else:
        x = hidden + sum(embeds)
        x = x + F.silu(x @ head.layers[0].weight.T + head.layers[0].bias)
    for layer in head.layers[1:]:
        x = x + F.silu(x @ layer.weight.T + layer.bias)
    return x @ lm_head.T


@pytest.mark.parametrize("combine", ["concat", "sum"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_each_head_is_the_papers_function_of_the_hidden_state_and_its_path(combine, share, num_layers):
    torch.manual_seed(0)
    K, H, V = 3, 8, 13
    heads = randomised(HydraHeads(HydraSpec(K, num_layers, H, V, share_lm_head=share, combine=combine)))
    base_lm = torch.randn(V, H)
    hidden, path = torch.randn(2, 5, H), torch.randn(2, 5, K, H)
    logits = heads(hidden, path, base_lm)
    assert logits.shape == (K, 2, 5, V)
    for k in range(K):
        lm = base_lm if share else heads.lm_head_weight[k]
        expected = reference_head(heads, k, hidden, [path[..., j, :] for j in range(k + 1)], lm)
        torch.testing.assert_close(logits[k], expected, rtol=1e-5, atol=1e-5)
        # one level of the tree at a time gives the same logits as all heads teacher forced
        torch.testing.assert_close(heads.head_logits(k, hidden, path[..., : k + 1, :], base_lm), logits[k])
    if combine == "concat":  # head k's first block reads (k + 2) H inputs
        assert [h.layers[0].weight.shape[1] for h in heads.heads] == [2 * H, 3 * H, 4 * H]


def test_shifted_path_tokens_are_the_next_k_tokens_padded_past_the_end():
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    path = shifted_path_tokens(tokens, 3, pad=0)
    assert path.shape == (2, 4, 3)
    assert path[0].tolist() == [[6, 7, 8], [7, 8, 0], [8, 0, 0], [0, 0, 0]]
    assert path[1, 1].tolist() == [3, 4, 0]


def test_head_k_reads_exactly_the_tokens_t_plus_1_to_t_plus_k_plus_1():
    """Teacher forced through SpeculativeModel.forward: changing the token at position j changes head k at t exactly
    when t < j <= t + k + 1 (its hidden state at t is causal, its path is t+1 .. t+k+1)."""
    base = make_tiny_model("llama")
    model = SpeculativeModel(base, randomised(new_heads_for(base, 3, head_type="hydra")))
    ids = torch.tensor([[1, 5, 9, 33, 20, 44, 12, 90, 3]])
    j = 6
    changed = ids.clone()
    changed[0, j] = 71
    with torch.no_grad():
        a, b = model(ids).head_logits, model(changed).head_logits  # [K, 1, T, V]
    for k in range(3):
        for t in range(j):  # positions whose hidden state does not see token j
            differs = not torch.allclose(a[k, 0, t], b[k, 0, t])
            assert differs == (t + k + 1 >= j), (k, t)


def test_fresh_concat_heads_predict_what_the_base_predicts_next():
    base = make_tiny_model("llama")
    for share in (False, True):
        model = SpeculativeModel(base, new_heads_for(base, 4, num_layers=2, share_lm_head=share, head_type="hydra"))
        ids = torch.tensor([[1, 5, 9, 33, 20, 44]])
        with torch.no_grad():
            out = model(ids)
        torch.testing.assert_close(out.head_logits, out.logits.expand(4, 1, 6, VOCAB))
        assert model.head_type == "hydra" and model.heads.spec.in_features(1) == 3 * HIDDEN


def test_model_helpers_refuse_the_wrong_call_for_the_heads():
    base = make_tiny_model("llama")
    hydra = SpeculativeModel(base, new_heads_for(base, 2, head_type="hydra"))
    medusa = SpeculativeModel(base, new_heads_for(base, 2))
    hidden = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match="Hydra heads read the path tokens"):
        hydra.head_logits(hidden)
    readers = titles(e for e in drafter_types() if e.reads_path)  # Hydra, and every type added since that reads it
    with pytest.raises(ValueError, match=f"path_tokens is for {readers} heads"):
        medusa.head_logits(hidden, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="these are Medusa heads"):
        medusa.head_logits_at(0, hidden, torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"head 1 needs path_embeds \[\.\.\., 2, 32\]"):
        hydra.heads.head_logits(1, hidden, torch.zeros(3, 1, HIDDEN))


def test_invalid_specs_are_refused():
    with pytest.raises(ValueError, match=r"heads.combine\) must be one of \('concat', 'sum'\), got 'mean'"):
        HydraSpec(2, 1, 8, 11, combine="mean")
    with pytest.raises(TypeError, match="HydraHeads needs a HydraSpec"):
        HydraHeads(HeadsSpec(2, 1, 8, 11))
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1"):
        HydraSpec(2, 0, 8, 11)
    with pytest.raises(ValueError, match="token_map must be a \\[4\\] long tensor"):
        HydraHeads(HydraSpec(2, 1, 8, 11, head_vocab_size=4))
    with pytest.raises(ValueError, match="head_type must be medusa or hydra"):
        new_heads_for(make_tiny_model("llama"), 2, head_type="eagle")


@pytest.mark.parametrize("overrides,message", [
    (["heads=hydra", "heads.combine=mean"], r"heads.combine must be one of \('concat', 'sum'\)"),
    (["heads.combine=sum"], "heads.combine=sum is for Hydra heads"),
    (["heads=hydra", "heads.mode=joint"], "heads.head_type=hydra trains the heads on a frozen base"),
    (["heads.head_type=eagle"], re.escape(f"heads.head_type must be one of {head_types()}")),  # every type
    (["heads=hydra", "push_to_hub=true", "hub_repo_id=me/heads"], "medusa-publish publishes Medusa heads"),
    (["heads=hydra", "heads.num_layers=0"], "heads.num_layers must be >= 1"),
])
def test_invalid_hydra_settings_are_refused_before_any_model_loads(tmp_path, overrides, message):
    # the model path does not exist: an error about it would mean the settings were checked too late
    cfg = compose_train(tiny_overrides(tmp_path / "no_model", tmp_path / "no_data.jsonl", tmp_path / "run")
                        + overrides)
    with pytest.raises(ValueError, match=message):
        build_recipe(cfg)
    assert not (tmp_path / "run").exists()


def test_heads_hydra_composes_with_the_default_recipe(tmp_path):
    cfg = compose_train([f"output_dir={tmp_path}", "heads=hydra"])
    recipe_cfg = build_recipe(cfg).cfg
    assert (recipe_cfg.heads.head_type, recipe_cfg.heads.combine, recipe_cfg.heads.mode) == ("hydra", "concat",
                                                                                              "frozen_base")
