"""Medusa-2 (joint training): losses and ramp by hand, the LoRA original kept bit for bit, reduction to Medusa-1,
two stages, resume, export with the merged base and decoding on it, and the bad inputs that fail before training."""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, TrainerCallback

from medusa_train.config.schema import HeadsConfig, LoraSettings
from medusa_train.export import load_heads, read_export_config, save_export
from medusa_train.loading.export import load_export
from medusa_train.models.speculative import new_heads_for
from medusa_train.training import checkpoints
from medusa_train.training.joint import (
    JointModel,
    causal_lm,
    lora_target_modules,
    prepare_base,
    trainable_state,
)
from medusa_train.training.joint_loss import base_loss_sum, chunked_base_loss_sum, kl_loss_sum, lm_loss_sum, ramp
from medusa_train.training.joint_trainer import TRAINABLE_FILE
from medusa_train.training.recipe import build_recipe
from tests.conftest import make_tiny_model
from tests.medusa_train.test_training import (
    CrashAtStep,
    assert_same_heads,
    compose_train,
    exported_heads,
    tiny_overrides,
    write_tiny_inputs,
)


pytestmark = pytest.mark.usefixtures("one_thread")


def joint_overrides(model_dir: Path, data: Path, output_dir: Path, **extra: object) -> list[str]:
    """``tiny_overrides`` with ``heads=medusa2``: LoRA rank 4 without dropout, constant ramp, no stage 1."""
    settings = {"heads.stage1_epochs": 0, "heads.lora.r": 4, "heads.lora.dropout": 0.0,
                "heads.loss_ramp": "constant", **extra}
    return ["heads=medusa2", *tiny_overrides(model_dir, data, output_dir, **settings)]


def lora_heads_config(**lora: object) -> HeadsConfig:
    return HeadsConfig(mode="joint", finetune="lora", lora=LoraSettings(**{"r": 4, "dropout": 0.0, **lora}))


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> tuple[Path, Path]:
    return write_tiny_inputs(tmp_path_factory.mktemp("tiny2"))


@pytest.fixture(scope="module")
def lora_run(tiny_inputs, tmp_path_factory):
    """Two stages (stage 1: 1 epoch of heads alone; joint: 8 LoRA steps with lambda_0 = 0), kept in memory."""
    model_dir, data = tiny_inputs
    out = tmp_path_factory.mktemp("lora") / "run"
    recipe = build_recipe(compose_train(joint_overrides(model_dir, data, out, **{
        "heads.stage1_epochs": 1, "heads.medusa_loss_weight": 0.0})))
    recipe.run()
    return recipe, out


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 40, 41, 42, 100, 7, 300, 12, 13, 14, 90, 91]])


# ---- losses and ramp by hand --------------------------------------------------------------------------------------

def test_ramp_values_by_hand():
    assert ramp("constant", 0, 10) == 1.0
    assert ramp("linear", 0, 10) == 0.0 and ramp("linear", 5, 10) == 0.5 and ramp("linear", 12, 10) == 1.0
    assert ramp("sine", 5, 10) == pytest.approx(math.sin(math.pi / 4)) and ramp("sine", 10, 10) == 1.0
    assert ramp("linear", 0, 0) == 1.0  # no ramp
    with pytest.raises(ValueError, match="heads.loss_ramp"):
        ramp("cosine", 1, 10)


def test_lm_and_kl_losses_count_positions_that_predict_assistant_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 4, -100]])  # positions 1 and 2 predict labelled tokens
    total, count = lm_loss_sum(logits, labels)
    expected = F.cross_entropy(logits[0, 1:3], torch.tensor([3, 4]), reduction="sum")
    assert count.item() == 2 and total.item() == pytest.approx(expected.item(), rel=1e-6)

    same, n = kl_loss_sum(logits, logits.clone(), labels)
    assert same.item() == 0.0 and n.item() == 2
    reference = logits.clone()
    reference[0, 0] += 5.0  # position 0 predicts an unlabelled token: not counted
    assert kl_loss_sum(logits, reference, labels)[0].item() == 0.0
    reference[0, 2, 1] += 3.0
    p, q = F.log_softmax(reference[0, 2], -1), F.log_softmax(logits[0, 2], -1)
    by_hand = (p.exp() * (p - q)).sum()
    assert kl_loss_sum(logits, reference, labels)[0].item() == pytest.approx(by_hand.item(), rel=1e-5)


@pytest.mark.parametrize("kind", ["lm", "kl"])
def test_the_base_loss_in_chunks_equals_the_logits_held_at_once(kind):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    reference = torch.randn(2, 7, 16)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, :3] = -100  # a prompt
    labels[1, 5:] = -100  # padding: 8 positions predict a labelled token (4 a row)
    whole, count = base_loss_sum(kind, lm_head(hidden), labels, lm_head(reference).detach())
    whole.backward()
    expected = (whole.item(), hidden.grad.clone(), lm_head.weight.grad.clone())
    hidden.grad = lm_head.weight.grad = None
    entered = []

    def gather():  # stands in for ZeRO-3's gathering of a partitioned weight: entered in both passes
        entered.append(1)
        return contextlib.nullcontext()

    chunked, n = chunked_base_loss_sum(kind, lm_head.weight, hidden, labels, 3, reference_hidden=reference,
                                       gather=gather)  # 3 chunks: 3, 3 and 2 positions
    chunked.backward()
    assert n.item() == count.item() == 8 and len(entered) == 2  # around the forward pass, and the backward pass
    assert chunked.item() == pytest.approx(expected[0], rel=1e-6) and chunked.item() > 0.1
    torch.testing.assert_close(hidden.grad, expected[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lm_head.weight.grad, expected[2], rtol=1e-5, atol=1e-7)


def test_the_base_loss_in_chunks_refuses_bad_arguments_by_field():
    hidden, labels, lm_head = torch.zeros(1, 4, 8), torch.zeros(1, 4, dtype=torch.long), torch.nn.Linear(8, 10)
    with pytest.raises(ValueError, match="heads.base_loss must be lm or kl"):
        chunked_base_loss_sum("ce", lm_head.weight, hidden, labels, 2)
    with pytest.raises(ValueError, match="reference_hidden"):
        chunked_base_loss_sum("kl", lm_head.weight, hidden, labels, 2)
    with pytest.raises(ValueError, match=r"trainer\.loss_chunk_size"):
        chunked_base_loss_sum("lm", lm_head.weight, hidden, labels, 0)


# ---- LoRA: the original model is the same module with its adapters disabled -------------------------------------

def test_kl_is_zero_at_start_with_lora_and_positive_after_a_step():
    base = make_tiny_model("llama", vocab_size=512)
    joint = JointModel(prepare_base(base, lora_heads_config()), new_heads_for(base, 2))
    labels = IDS.clone()
    out = joint(IDS, with_reference=True)
    assert torch.equal(out.logits, out.reference_logits)  # B = 0: the adapters add exactly nothing
    assert kl_loss_sum(out.logits, out.reference_logits, labels)[0].item() == 0.0
    adapters = [p for n, p in joint.named_parameters() if "lora_" in n]
    assert len(adapters) == 2 * 4 * 2  # A and B, four projections, two layers
    optimizer = torch.optim.SGD(adapters, lr=0.5)
    loss, count = lm_loss_sum(out.logits, labels)
    (loss / count).backward()
    optimizer.step()
    after = joint(IDS, with_reference=True)
    kl, _ = kl_loss_sum(after.logits, after.reference_logits, labels)
    assert kl.item() > 1e-6


def test_default_lora_targets_by_family_and_missing_targets_are_named():
    assert lora_target_modules(make_tiny_model("llama"), None) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_target_modules(make_tiny_model("gpt2"), None) == ["c_attn", "c_proj"]
    with pytest.raises(ValueError, match=r"heads.lora.target_modules: \['w_qkv'\].*'o_proj'.*'up_proj'"):
        lora_target_modules(make_tiny_model("qwen2"), ["q_proj", "w_qkv"])


def test_gpt2_lora_starts_as_the_original_model():
    base = make_tiny_model("gpt2")
    original = make_tiny_model("gpt2")
    peft_model = prepare_base(base, lora_heads_config())
    assert torch.equal(logits_of(peft_model, IDS % 97), logits_of(original, IDS % 97))


# ---- training ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_frozen_base_unit_weight_trains_the_same_heads_as_medusa1(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "m1"))).run()
    joint = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "m2", **{
        "heads.finetune": "frozen", "heads.medusa_loss_weight": 1.0, "heads.heads_lr_multiplier": 1.0})))
    joint.run()
    assert_same_heads(exported_heads(tmp_path / "m1" / "export"), exported_heads(tmp_path / "m2" / "export"))
    config = read_export_config(tmp_path / "m2" / "export")
    assert config["base_model_name_or_path"] == str(model_dir)  # the base did not change: no copy in the export
    assert not (tmp_path / "m2" / "export" / "base").exists()
    logged = [e for e in joint.trainer.state.log_history if "base_loss" in e]
    assert len(logged) == 4 and all(e["medusa_weight"] == 1.0 for e in logged)
    assert logged[0]["base_loss"] == pytest.approx(logged[-1]["base_loss"], rel=0.2)  # frozen: same model, new rows


def test_two_stages_with_zero_head_weight_keep_the_stage1_heads(lora_run):
    recipe, out = lora_run
    stage1 = out / "stage1" / "export"
    assert (stage1 / "config.json").is_file() and recipe.summary["stage1"]["global_step"] == 4  # 16 rows / 4
    assert read_export_config(stage1)["training"]["mode"] == "frozen_base"
    # lambda_0 = 0: the heads get zero gradients, AdamW moves them by exactly nothing
    a, b = exported_heads(stage1), exported_heads(out / "export")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert recipe.summary["global_step"] == 8
    logged = [e for e in recipe.trainer.state.log_history if "base_loss" in e]
    assert len(logged) == 4 and logged[-1]["base_loss"] < logged[0]["base_loss"]
    assert all(e["medusa_weight"] == 0.0 for e in logged)


def test_heads_learn_four_times_faster_than_the_adapters(lora_run):
    recipe, _ = lora_run
    model = recipe.trainer.model
    heads_ids = {id(p) for p in model.heads.parameters()}
    lora_ids = {id(p) for n, p in model.base.named_parameters() if "lora_" in n}
    groups = recipe.trainer.optimizer.param_groups
    by_lr = {}
    for g in groups:
        by_lr.setdefault(g["initial_lr"], set()).update(id(p) for p in g["params"])
    assert by_lr == {1e-2: lora_ids, 4e-2: heads_ids}
    assert all(not p.requires_grad for n, p in model.base.named_parameters() if "lora_" not in n)


def test_disabled_adapters_give_the_original_model_bit_for_bit_after_training(lora_run, tiny_inputs):
    recipe, _ = lora_run
    model_dir, _ = tiny_inputs
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    peft_model = recipe.trainer.model.base.eval()
    with peft_model.disable_adapter():
        disabled = logits_of(peft_model, IDS)
    assert torch.equal(disabled, logits_of(original, IDS))
    assert not torch.allclose(logits_of(peft_model, IDS), disabled, atol=1e-4)  # the adapters did train


def test_export_holds_the_merged_base_and_decodes_like_it(lora_run, tmp_path):
    from inference.decoders import DecodeConfig, TreeDecoder, VanillaDecoder
    from medusa_train.tree.buffers import SMALL_TREE_15

    recipe, out = lora_run
    export = out / "export"
    config = read_export_config(export)
    assert config["base_model_name_or_path"] == "base"
    assert config["original_base_model_name_or_path"] == recipe.cfg.model.name_or_path
    assert config["training"]["finetune"] == "lora" and config["training"]["base_loss"] == "lm"
    merged = AutoModelForCausalLM.from_pretrained(export / "base", dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits_of(merged, IDS), logits_of(recipe.trainer.model.base.eval(), IDS),
                               atol=1e-5, rtol=1e-5)
    moved = tmp_path / "moved"
    shutil.copytree(export, moved)  # the base is found relative to the export folder, wherever it goes
    model, tokenizer, _ = load_export(str(moved))
    assert Path(model.base.config._name_or_path).resolve() == (moved / "base").resolve()
    assert torch.equal(logits_of(model.base, IDS), logits_of(merged, IDS))
    assert tokenizer.vocab_size == 512
    decoder = TreeDecoder(model, [list(p) for p in SMALL_TREE_15 if len(p) <= 2], topk=10)
    for prompt in ([1, 40, 41, 42], [1, 300, 12]):
        medusa = decoder.generate(prompt, DecodeConfig(max_new_tokens=24))
        assert medusa.tokens == VanillaDecoder(merged).generate(prompt, DecodeConfig(max_new_tokens=24)).tokens


@pytest.mark.slow
def test_gradient_checkpointing_of_the_base_trains_the_same_heads_and_adapters(tiny_inputs, tmp_path):
    """+trainer.extra.gradient_checkpointing=true (the memory plan's fix for a 70B Medusa-2): the base's layers are
    recomputed in the backward pass, so the trained weights equal those of a run that kept every activation."""
    model_dir, data = tiny_inputs
    runs = {}
    for name, extra in (("plain", {}), ("ckpt", {"+trainer.extra.gradient_checkpointing": "true"})):
        recipe = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / name, **extra)))
        recipe.run()
        if extra:
            assert recipe.trainer.model.base.is_gradient_checkpointing
        runs[name] = {n: p.detach().clone() for n, p in recipe.trainer.model.named_parameters() if p.requires_grad}
    assert sorted(runs["plain"]) == sorted(runs["ckpt"]) and any("lora" in n for n in runs["plain"])
    for n, p in runs["plain"].items():
        torch.testing.assert_close(runs["ckpt"][n], p, atol=1e-6, rtol=1e-5, msg=n)


def test_crashed_joint_run_resumes_to_the_same_heads_and_base(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "whole"))).run()
    run = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(joint_overrides(model_dir, data, run)), callbacks=[CrashAtStep(6)]).run()
    saved = run / "checkpoints" / "checkpoint-4" / TRAINABLE_FILE
    assert saved.is_file()
    resumed = build_recipe(compose_train(joint_overrides(model_dir, data, run, resume="true")))
    resumed.run()
    assert resumed.summary["resumed_from"] == str(run / "checkpoints" / "checkpoint-4")
    assert_same_heads(exported_heads(tmp_path / "whole" / "export"), exported_heads(run / "export"))
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "export" / "base")
    again = AutoModelForCausalLM.from_pretrained(run / "export" / "base")
    torch.testing.assert_close(logits_of(whole, IDS), logits_of(again, IDS), atol=1e-5, rtol=1e-5)


def joint_model(finetune: str = "lora") -> JointModel:
    base = make_tiny_model("llama", seed=0, vocab_size=512)
    config = lora_heads_config() if finetune == "lora" else HeadsConfig(mode="joint", finetune=finetune)
    return JointModel(prepare_base(base, config), new_heads_for(base, 2))


def test_the_trainers_non_strict_resume_loads_exactly_the_trainable_weights_back(tmp_path):
    trained = joint_model()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p))
    save_file(trainable_state(trained), str(tmp_path / TRAINABLE_FILE))
    saved = load_file(str(tmp_path / TRAINABLE_FILE))
    assert TRAINABLE_FILE == "model.safetensors"  # the name the stock Trainer resumes from
    assert {k.split(".")[0] for k in saved} == {"base", "heads"}
    assert all("lora_" in k for k in saved if k.startswith("base."))  # no frozen weight is stored

    fresh = joint_model()
    frozen_before = {n: p.clone() for n, p in fresh.named_parameters() if not p.requires_grad}
    result = fresh.load_state_dict(saved, False)  # what Trainer._load_from_checkpoint calls
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, p in fresh.named_parameters():
        expected = dict(trained.named_parameters())[name] if p.requires_grad else frozen_before[name]
        assert torch.equal(p, expected), name
    with pytest.raises(RuntimeError, match="Missing key"):  # strict loading is nn.Module's
        joint_model().load_state_dict(saved)
    with pytest.raises(ValueError, match=r"trainable weights do not match the model \(missing \['base\."
                                         r".*unexpected \['base\.base_model\.model\..*lora_A"):
        joint_model("full").load_state_dict(saved, False)  # written with other heads.finetune settings


class CheckpointSealed(TrainerCallback):
    """Record, at each on_save, whether the checkpoint is already complete (sealed before other callbacks run)."""

    def __init__(self) -> None:
        self.seen: dict[int, str | None] = {}

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.seen[state.global_step] = checkpoints.incomplete_reason(folder, verify=True)


@pytest.mark.slow
def test_a_resumed_joint_run_checkpoints_the_same_trainable_weights_as_an_uninterrupted_one(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    sealed = CheckpointSealed()
    whole = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "whole")), callbacks=[sealed])
    whole.run()
    assert sealed.seen == {4: None, 8: None}  # every on_save callback sees a sealed checkpoint
    trainable = {n for n, p in whole.trainer.model.named_parameters() if p.requires_grad}
    run = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(joint_overrides(model_dir, data, run)), callbacks=[CrashAtStep(6)]).run()
    assert set(load_file(str(run / "checkpoints" / "checkpoint-4" / TRAINABLE_FILE))) == trainable
    build_recipe(compose_train(joint_overrides(model_dir, data, run, resume="true"))).run()
    a = load_file(str(tmp_path / "whole" / "checkpoints" / "checkpoint-8" / TRAINABLE_FILE))
    b = load_file(str(run / "checkpoints" / "checkpoint-8" / TRAINABLE_FILE))
    assert set(a) == set(b) == trainable
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=f"{name} differs")


# ---- bad input, before training ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "field"), [
    ("heads.loss_ramp=cosine", "heads.loss_ramp"),
    ("heads.finetune=qlora", "heads.finetune"),
    ("heads.base_loss=mse", "heads.base_loss"),
    ("hidden_cache=true", "hidden_cache"),
    ("heads.lora.r=0", "heads.lora.r"),
    ("heads.init_from=/some/export", "heads.init_from"),  # with stage1_epochs=1 (medusa2.yaml's default)
])
def test_bad_joint_settings_fail_at_config_time(override, field, tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    overrides = ["heads=medusa2", *tiny_overrides(model_dir, data, tmp_path / "run"), override]
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_recipe(compose_train(overrides))


def test_kl_with_full_fine_tuning_and_stage_settings_on_medusa1_are_refused(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    with pytest.raises(ValueError, match="base_loss=kl with heads.finetune=full"):
        build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path, **{
            "heads.finetune": "full", "heads.base_loss": "kl"})))
    with pytest.raises(ValueError, match="heads.base_loss=lm or heads.finetune=lora"):  # kl from self_distill
        build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path, **{
            "heads.finetune": "full", "data.self_distill": "true"})))
    with pytest.raises(ValueError, match="heads.stage1_epochs is for joint training"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path, **{"heads.stage1_epochs": 1})))


def test_missing_lora_targets_fail_before_the_data_is_prepared(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "run", **{
        "heads.lora.target_modules": "[q_proj,query_key_value]"})))
    with pytest.raises(ValueError, match=r"\['query_key_value'\] are not linear layers.*'gate_proj'"):
        recipe.run()
    assert not hasattr(recipe, "data")


def test_heads_exported_for_another_base_are_refused(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    other = make_tiny_model("llama", seed=1, vocab_size=512, hidden_size=48)
    save_export(new_heads_for(other, 2), tmp_path / "other_export", "someone/other-model", vllm=False)
    recipe = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "run", **{
        "heads.init_from": str(tmp_path / "other_export")})))
    with pytest.raises(ValueError, match=r"heads.init_from=.*'someone/other-model'.*model.name_or_path"):
        recipe.run()
    assert recipe.trainer is None
    # an export of this very base (stage-1 style) but of another shape: the heads/ fields are named
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    save_export(new_heads_for(base, 3), tmp_path / "three", str(model_dir), vllm=False)
    recipe = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "run3", **{
        "heads.init_from": str(tmp_path / "three")})))
    with pytest.raises(ValueError, match=r"heads.num_heads=2 \(the export has 3\)"):
        recipe.run()
    loaded, _ = load_heads(tmp_path / "three")
    assert loaded.spec.num_heads == 3 and causal_lm(base) is base


def test_full_fine_tuning_trains_every_base_weight_and_exports_it(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(joint_overrides(model_dir, data, tmp_path / "full", **{
        "heads.finetune": "full", "trainer.max_steps": 4, "trainer.learning_rate": 1e-3})))
    recipe.run()
    base = recipe.trainer.model.base.eval()
    assert all(p.requires_grad for p in base.parameters())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "export" / "base").eval()
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert torch.equal(logits_of(exported, IDS), logits_of(base, IDS))
    assert not torch.allclose(logits_of(exported, IDS), logits_of(original, IDS), atol=1e-4)
