"""Hydra heads through the Medusa-1 pipeline: the packed loss by hand, training, the hidden-state cache, resume, the
export and its head type, and the loaders that refuse heads of the other type."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_train.models.catalog import head_types
from medusa_train.export import load_heads, read_export_config, save_export
from medusa_train.models.catalog import shifted_path_tokens
from medusa_train.drafters.hydra.heads import HydraHeads, HydraSpec
from medusa_train.loading.export import load_export
from medusa_train.models.speculative import new_heads_for
from medusa_train.publish.folder import collect_export
from medusa_train.training.losses import heads_loss
from medusa_train.training.recipe import build_recipe
from tests.conftest import HIDDEN, VOCAB, make_tiny_model
from tests.medusa_train.test_export import TOKEN_MAP, hidden_states, random_heads, randomized
from tests.medusa_train.test_training import (
    CrashAtStep,
    assert_same_heads,
    compose_train,
    exported_heads,
    tiny_overrides,
    write_tiny_inputs,
)

HYDRA = {"heads": "hydra", "heads.num_heads": 2, "heads.target": "labels"}


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    return write_tiny_inputs(tmp_path_factory.mktemp("tiny_hydra"))


def random_hydra(num_heads: int = 2, num_layers: int = 1, share: bool = False, token_map: torch.Tensor | None = None,
                 combine: str = "concat", dtype: torch.dtype = torch.float32, seed: int = 0) -> HydraHeads:
    spec = HydraSpec(num_heads, num_layers, HIDDEN, VOCAB, share_lm_head=share, combine=combine,
                     head_vocab_size=None if token_map is None else token_map.numel())
    return randomized(HydraHeads(spec, token_map=token_map), seed, dtype)


# ---- export and load ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_map", [None, TOKEN_MAP], ids=["full_vocab", "token_map"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("combine", ["concat", "sum"])
def test_hydra_round_trip_gives_identical_logits(tmp_path, combine, share, token_map, dtype):
    base = make_tiny_model("llama")
    heads = random_hydra(num_layers=2, share=share, token_map=token_map, combine=combine, dtype=dtype)
    save_export(heads, tmp_path, "tiny-llama", vllm=False, base_model=base)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.json", "hydra_heads.safetensors"] + ([] if token_map is None else ["token_map.safetensors"]))
    loaded, config = load_heads(tmp_path, base_model=base)
    assert isinstance(loaded, HydraHeads) and loaded.spec == heads.spec and loaded.dtype == dtype
    assert config["head_type"] == "hydra" and config["hydra_combine"] == combine and "medusa_num_heads" not in config
    hidden, path = hidden_states(dtype), torch.randn(2, 5, 2, HIDDEN).to(dtype)
    weight = base.lm_head.weight.to(dtype) if share else None
    assert torch.equal(loaded(hidden, path, weight), heads(hidden, path, weight))


def test_each_head_type_refuses_to_load_as_the_other_naming_it(tmp_path):
    hydra, medusa = tmp_path / "hydra", tmp_path / "medusa"
    save_export(random_hydra(), hydra, "tiny-llama", vllm=False)
    save_export(random_heads(), medusa, "tiny-llama", vllm=False)
    with pytest.raises(ValueError, match=r"holds Hydra heads \(head_type 'hydra'\), but Medusa heads"):
        load_heads(hydra, head_type="medusa")
    with pytest.raises(ValueError, match=r"holds Medusa heads \(head_type 'medusa'\), but Hydra heads"):
        load_heads(medusa, head_type="hydra")
    # before the base model loads: "tiny-llama" is no model anywhere
    with pytest.raises(ValueError, match=r"holds Hydra heads \(head_type 'hydra'\), but Medusa heads"):
        load_export(str(hydra), head_type="medusa")
    with pytest.raises(ValueError, match=r"hydra heads \(head_type 'hydra'\): medusa-publish publishes Medusa"):
        collect_export(hydra)
    with pytest.raises(ValueError, match="load_heads\\(head_type=...\\): head_type 'eagle' is not one"):
        load_heads(medusa, head_type="eagle")


def test_unknown_head_type_in_config_is_refused(tmp_path):
    save_export(random_hydra(), tmp_path, "tiny-llama", vllm=False)
    config = read_export_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_type": "eagle"}))
    known = re.escape(f"({', '.join(head_types())})")  # every registered type
    with pytest.raises(ValueError, match=r"config.json: head_type 'eagle' is not one this medusa-train knows " + known):
        load_heads(tmp_path)


def test_hydra_weights_are_read_strictly(tmp_path):
    save_export(random_hydra(), tmp_path, "tiny-llama", vllm=False)
    path = tmp_path / "hydra_heads.safetensors"
    state = load_file(path)
    state.pop("heads.1.residual.weight")
    state["heads.1.layers.0.weight"] = torch.zeros(HIDDEN, HIDDEN)
    save_file(state, path)
    with pytest.raises(ValueError, match=r"missing keys \['heads.1.residual.weight'\]"):
        load_heads(tmp_path)
    config = read_export_config(tmp_path)
    del config["hydra_combine"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\(head_type hydra\) is missing \['hydra_combine'\]"):
        load_heads(tmp_path)


def test_vllm_layout_is_refused_for_hydra_heads_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"vLLM's Medusa loader reads Medusa heads only and these are Hydra heads"):
        save_export(random_hydra(), tmp_path / "out", "tiny-llama", vllm=True)
    assert not (tmp_path / "out").exists()


def test_reexport_of_the_other_head_type_leaves_no_heads_of_the_first(tmp_path):
    base = make_tiny_model("llama")
    save_export(random_heads(), tmp_path, "tiny-llama", vllm=True, base_model=base)
    (tmp_path / "medusa_choices.json").write_text("[[0]]")  # a file of another tool: kept
    save_export(random_hydra(), tmp_path, "tiny-llama", vllm=False, base_model=base)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "hydra_heads.safetensors",
                                                          "medusa_choices.json"]
    save_export(random_heads(), tmp_path, "tiny-llama", vllm=False, base_model=base)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "medusa_choices.json",
                                                          "medusa_lm_head.pt", "medusa_lm_head.safetensors"]
    assert "head_type" not in read_export_config(tmp_path)  # Medusa exports stay as FasterDecoding reads them


# ---- the loss -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [0, 3])  # 0: the logits held at once; 3: rows projected three at a time
@pytest.mark.parametrize("target", ["labels", "base_argmax", "soft"])
def test_hydra_heads_run_only_where_counted_and_give_the_teacher_forced_dense_loss_and_gradient(target, chunk):
    from medusa_train.training.step import FrozenBase, LossSpec, heads_on_batch

    torch.manual_seed(0)
    V, H, K, T = 12, 8, 3, 9
    heads = HydraHeads(HydraSpec(num_heads=K, num_layers=1, hidden_size=H, vocab_size=V))
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0, 0.5)
    lm_head, embed = torch.nn.Linear(H, V, bias=False), torch.nn.Embedding(V, H)
    base = FrozenBase(backbone=None, lm_head=lm_head, embed=embed)
    input_ids = torch.randint(0, V, (2, T))
    labels = input_ids.clone()
    labels[:, :3] = -100
    labels[1, T - 2:] = -100
    hidden = torch.randn(2, T, H)
    base_logits = lm_head(hidden).detach()
    batch = {"hidden": hidden, "base_argmax": base_logits.argmax(-1), "labels": labels, "input_ids": input_ids}
    spec = LossSpec(target=target, decay=0.8, share_lm_head=False, vocab_size=V, num_heads=K, head_type="hydra",
                    loss_chunk_size=chunk)

    packed = heads_on_batch(heads, base, batch, spec)
    packed.loss.backward()
    packed_grads = [p.grad.clone() for p in heads.parameters()]
    heads.zero_grad()
    path = embed(shifted_path_tokens(input_ids, K)).detach()  # [B, T, K, H]: the true tokens t+1 .. t+K
    dense = heads_loss(heads(hidden, path), labels, target=target, decay=0.8, base_argmax=batch["base_argmax"],
                             base_logits=base_logits if target == "soft" else None)
    dense.loss.backward()
    assert packed.count.tolist() == dense.count.tolist() == [10, 10, 8]
    assert packed.correct_top1.tolist() == dense.correct_top1.tolist()
    assert packed.loss.item() == pytest.approx(dense.loss.item(), rel=1e-6)
    for got, param in zip(packed_grads, heads.parameters()):  # chunks sum the same terms in another order
        assert torch.allclose(got, param.grad, rtol=1e-5, atol=1e-6 if chunk else 1e-7)
    assert all(g.abs().sum() > 0 for g in packed_grads)  # every head, every layer learns


# ---- training -----------------------------------------------------------------------------------------------------

def test_hydra_training_learns_and_the_cache_trains_the_same_heads(tiny_inputs, tmp_path, caplog):
    """Plain and hidden-cache runs give the same heads; they learn; export_vllm=true is skipped with a warning."""
    model_dir, data = tiny_inputs
    plain = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "plain", export_vllm="true",
                                                     **{**HYDRA, "trainer.max_steps": 20})))
    plain.setup()
    from medusa_train.training.head_accuracy import head_accuracy

    before = head_accuracy(plain.trainer.model, plain.frozen_base, plain.eval_set, plain.collator, plain.loss_spec, 8,
                           "cpu")
    with caplog.at_level(logging.WARNING):
        plain.train()
        export_dir = plain.save()
    plain.cleanup()
    assert "export_vllm=true is skipped for Hydra heads" in caplog.text
    after = plain.summary["accuracy"]
    for k in range(2):
        assert after["loss"][k] < 0.6 * before["loss"][k]
        assert after["top1"][k] > before["top1"][k] + 0.2
    assert not (export_dir / "vllm").exists() and not (export_dir / "medusa_lm_head.safetensors").exists()
    loaded, config = load_heads(export_dir, head_type="hydra")
    for name, tensor in plain.trainer.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    assert config["hydra_num_heads"] == 2 and config["training"]["global_step"] == 20

    cached = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "cached", hidden_cache="true",
                                                      **{**HYDRA, "trainer.max_steps": 20})))
    cached.run()
    assert cached.frozen_base.backbone is None
    assert_same_heads(exported_heads(export_dir), exported_heads(tmp_path / "cached" / "export"))


def test_crashed_hydra_run_resumes_to_the_same_heads(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "whole", **HYDRA))).run()
    run = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, run, **HYDRA)), callbacks=[CrashAtStep(6)]).run()
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["checkpoint-4"]
    resumed = build_recipe(compose_train(tiny_overrides(model_dir, data, run, resume="true", **HYDRA)))
    resumed.run()
    assert resumed.summary["resumed_from"] == str(run / "checkpoints" / "checkpoint-4")
    assert_same_heads(exported_heads(tmp_path / "whole" / "export"), exported_heads(run / "export"))


def test_hydra_export_cannot_start_a_medusa2_run(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    export = tmp_path / "hydra_export"
    base = make_tiny_model("llama", vocab_size=512)
    heads = new_heads_for(base, 2, head_type="hydra")
    save_export(heads, export, str(model_dir), vllm=False)
    cfg = compose_train(tiny_overrides(model_dir, data, tmp_path / "m2", **{
        "heads": "medusa2", "heads.num_heads": 2, "heads.stage1_epochs": 0, "heads.init_from": str(export)}))
    with pytest.raises(ValueError, match=r"heads.init_from=.*holds Hydra heads \(head_type 'hydra'\), but Medusa"):
        build_recipe(cfg).check()
