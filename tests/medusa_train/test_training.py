"""Medusa-1 training: loss alignment and masking by hand, training on a tiny model, hidden cache, checkpoints, resume,
and the bad inputs that must fail before training starts."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import TrainerCallback

from medusa_train.files.checksums import file_sha256
from medusa_train.cli.train import register_schemas
from medusa_train.config.schema import TrainerConfig
from medusa_train.export import load_heads
from medusa_train.loading.llama2c import load_llama2c_tokenizer
from medusa_train.files.paths import CONF_DIR, assets_dir
from medusa_train.training import checkpoints
from medusa_train.training.arguments import check_deepspeed_batch
from medusa_train.training.losses import decay_weights, heads_loss, packed_head_loss, valid_mask
from medusa_train.training.recipe import build_recipe, gather_trainable_state
from tests.conftest import make_tiny_model

register_schemas()  # what conf/train.yaml composes from (also for the tests importing compose_train)

# ---- shared helpers (also used by test_distributed.py) ------------------------------------------------------------

WORDS = "one two three four five six seven eight nine ten".split()


def counting_conversations(n: int) -> list[dict]:
    """``n`` ShareGPT records: "count from W" -> the next words of a fixed cycle (predictable for the heads)."""
    records = []
    for i in range(n):
        start = i % len(WORDS)
        reply = " ".join(WORDS[(start + j) % len(WORDS)] for j in range(12 + i % 7))  # distinct for i < 70
        records.append({"conversations": [{"from": "human", "value": f"count from {WORDS[start]}"},
                                          {"from": "gpt", "value": reply}]})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_tiny_inputs(folder: Path, conversations: int = 20) -> tuple[Path, Path]:
    """A tiny Llama (vocab 512, the stories260K tokenizer) saved as an HF folder, and a conversation file."""
    model_dir = folder / "tiny_llama"
    if not (model_dir / "config.json").is_file():
        model = make_tiny_model("llama", seed=0, vocab_size=512)
        tokenizer = load_llama2c_tokenizer(assets_dir() / "stories260K" / "tok512.bin")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    data = write_jsonl(folder / "conversations.jsonl", counting_conversations(conversations))
    return model_dir, data


def tiny_overrides(model_dir: Path, data_file: Path, output_dir: Path, **extra: object) -> list[str]:
    """Hydra overrides for a fast run on the tiny model: 2 heads, fp32, no export of vLLM files."""
    overrides = {
        "model.name_or_path": str(model_dir), "model.format": "hf", "model.tokenizer_path": "null",
        "data": "json", "data.path": str(data_file), "data.eval_fraction": 0.2,
        "heads.num_heads": 2, "heads.target": "labels",
        "trainer.per_device_train_batch_size": 4, "trainer.per_device_eval_batch_size": 8,
        "trainer.learning_rate": 1e-2, "trainer.max_steps": 8, "trainer.warmup_ratio": 0.0,
        "trainer.logging_steps": 2, "trainer.save_steps": 4, "trainer.disable_tqdm": True,
        "output_dir": str(output_dir), "max_length": 64, "export_vllm": False,
    }
    overrides.update(extra)
    return [f"{k}={v}" for k, v in overrides.items()]


def compose_train(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def exported_heads(export_dir: Path) -> dict[str, torch.Tensor]:
    """The exported head weights as stored (Medusa's FasterDecoding file, or Hydra's)."""
    hydra = export_dir / "hydra_heads.safetensors"
    return load_file(str(hydra if hydra.is_file() else export_dir / "medusa_lm_head.safetensors"))


def assert_same_heads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-4, msg=f"{key} differs")


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> tuple[Path, Path]:
    return write_tiny_inputs(tmp_path_factory.mktemp("tiny"))


# ---- losses -------------------------------------------------------------------------------------------------------

def one_hot_logits(token_ids: torch.Tensor, vocab: int, scale: float = 50.0) -> torch.Tensor:
    return F.one_hot(token_ids, vocab).float() * scale


def test_valid_mask_counts_positions_whose_target_t_plus_k_plus_2_is_labelled():
    labels = torch.tensor([[-100, -100, 12, 13, 14, -100, 15]])
    mask = valid_mask(labels, num_heads=2)
    # head 0 at t targets t+2: t=0..2 -> 12, 13, 14; t=4 -> 15 (t=3 -> position 5 is not labelled)
    assert mask[0, 0].tolist() == [True, True, True, False, True, False, False]
    # head 1 at t targets t+3: t=0 -> 13, t=1 -> 14, t=3 -> 15
    assert mask[1, 0].tolist() == [True, True, False, True, False, False, False]


def test_labels_target_is_the_token_at_t_plus_k_plus_2():
    V, K = 20, 3
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    labels = tokens.clone()
    T = tokens.shape[1]
    right = torch.zeros(K, 1, T, V)
    off_by_one = torch.zeros(K, 1, T, V)
    for k in range(K):
        for t in range(T - k - 2):
            right[k, 0, t] = one_hot_logits(tokens[0, t + k + 2], V)
            off_by_one[k, 0, t] = one_hot_logits(tokens[0, t + k + 1], V)
    good = heads_loss(right, labels, target="labels", decay=0.8)
    bad = heads_loss(off_by_one, labels, target="labels", decay=0.8)
    assert good.count.tolist() == [6, 5, 4]
    assert good.correct_top1.tolist() == [6, 5, 4]
    assert good.loss.item() < 1e-6
    assert bad.correct_top1.tolist() == [0, 0, 0]
    assert bad.loss.item() > 10


def test_base_argmax_target_is_the_base_greedy_token_made_at_t_plus_k_plus_1():
    V, K = 16, 2
    labels = torch.tensor([[1, 2, 3, 4, 5, 6]])
    base_argmax = torch.tensor([[9, 8, 7, 11, 12, 13]])  # the base's prediction for position t+1, made at t
    logits = torch.zeros(K, 1, 6, V)
    for k in range(K):
        for t in range(6 - k - 2):
            logits[k, 0, t] = one_hot_logits(base_argmax[0, t + k + 1], V)
    out = heads_loss(logits, labels, target="base_argmax", decay=1.0, base_argmax=base_argmax)
    assert out.correct_top1.tolist() == out.count.tolist() == [4, 3]
    # the same logits scored against the data tokens miss everywhere
    assert heads_loss(logits, labels, target="labels", decay=1.0).correct_top1.tolist() == [0, 0]


def test_decay_weights_and_normaliser_by_hand():
    assert decay_weights(3, 0.8).tolist() == pytest.approx([1.0, 0.8, 0.64])
    V, K = 7, 3
    labels = torch.tensor([[-100, 1, 2, 3, 4, 5]])  # 5 labelled tokens
    out = heads_loss(torch.zeros(K, 1, 6, V), labels, target="labels", decay=0.5)
    # uniform logits: every counted position costs ln V; counts are 4, 3, 2 (targets at t+2, t+3, t+4 <= 5)
    assert out.count.tolist() == [4, 3, 2]
    expected = (4 * 1.0 + 3 * 0.5 + 2 * 0.25) * math.log(V) / 5
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.loss_sum.tolist() == pytest.approx([4 * math.log(V), 3 * math.log(V), 2 * math.log(V)], rel=1e-6)
    halved = heads_loss(torch.zeros(K, 1, 6, V), labels, target="labels", decay=0.5, normalizer=10)
    assert halved.loss.item() == pytest.approx(expected / 2, rel=1e-6)


def test_masked_positions_do_not_change_the_loss():
    torch.manual_seed(0)
    V, K = 11, 2
    labels = torch.tensor([[-100, -100, -100, 4, 5, 6, -100, -100]])
    logits = torch.randn(K, 1, 8, V)
    changed = logits.clone()
    # at t >= 4 head 0 targets positions >= 6 and head 1 positions >= 7: unlabelled or past the end
    changed[:, :, 4:] = torch.randn(K, 1, 4, V)
    a = heads_loss(logits, labels, target="labels", decay=0.8)
    b = heads_loss(changed, labels, target="labels", decay=0.8)
    assert a.loss.item() == pytest.approx(b.loss.item())
    assert a.count.tolist() == [3, 3]  # head 0 at t=1, 2, 3 (targets 3, 4, 5); head 1 at t=0, 1, 2
    changed[0, :, 1] = torch.randn(V)  # a counted position: the loss moves
    assert heads_loss(changed, labels, target="labels", decay=0.8).loss.item() != pytest.approx(a.loss.item())


def test_soft_target_is_kl_to_the_base_distribution_at_t_plus_k_plus_1():
    torch.manual_seed(0)
    V, K, T = 9, 2, 6
    labels = torch.arange(T)[None]
    base_logits = torch.randn(1, T, V)
    matching = torch.zeros(K, 1, T, V)
    for k in range(K):
        matching[k, 0, : T - k - 1] = base_logits[0, k + 1 :]
    argmax = base_logits.argmax(-1)
    zero = heads_loss(matching, labels, target="soft", decay=1.0, base_argmax=argmax, base_logits=base_logits)
    assert zero.loss.item() == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(K, 1, T, V)
    out = heads_loss(other, labels, target="soft", decay=1.0, base_argmax=argmax, base_logits=base_logits)
    for k in range(K):
        expected = 0.0
        for t in range(T - k - 2):
            p = F.softmax(base_logits[0, t + k + 1], -1)  # the base's distribution for position t + k + 2
            expected += float((p * (p.log() - F.log_softmax(other[k, 0, t], -1))).sum())
        assert out.loss_sum[k].item() == pytest.approx(expected, rel=1e-5)


def test_reduced_head_vocabulary_skips_unknown_targets_in_the_loss_and_counts_them_as_misses():
    V, K = 10, 1
    token_map = torch.tensor([2, 5, 7])  # head index 0, 1, 2
    labels = torch.tensor([[0, 0, 5, 9]])  # targets of head 0: t=0 -> 5 (index 1), t=1 -> 9 (not in the head vocab)
    logits = torch.zeros(K, 1, 4, 3)
    logits[0, 0, 0, 1] = 50.0
    logits[0, 0, 1, 1] = 50.0
    out = heads_loss(logits, labels, target="labels", decay=1.0, token_map=token_map, vocab_size=V)
    assert out.count.tolist() == [2]
    assert out.correct_top1.tolist() == [1]
    assert out.loss_sum.item() == pytest.approx(0.0, abs=1e-6)


def test_loss_rejects_mismatched_shapes_and_missing_base_outputs():
    with pytest.raises(ValueError, match="head_logits must be"):
        heads_loss(torch.zeros(2, 1, 5, 4), torch.zeros(1, 6, dtype=torch.long), target="labels", decay=0.8)
    with pytest.raises(ValueError, match="base_argmax"):
        heads_loss(torch.zeros(2, 1, 5, 4), torch.zeros(1, 5, dtype=torch.long), target="base_argmax",
                         decay=0.8)
    with pytest.raises(ValueError, match="soft needs the base logits"):
        heads_loss(torch.zeros(2, 1, 5, 4), torch.zeros(1, 5, dtype=torch.long), target="soft", decay=0.8,
                         base_argmax=torch.zeros(1, 5, dtype=torch.long))
    targets = torch.tensor([[3, -100, 1], [2, -100, -100]])  # 3 counted rows of 2 heads at 3 positions
    with pytest.raises(ValueError, match=r"base_next must be \[R, V'\] = \(3, 4\)"):
        packed_head_loss(torch.zeros(2, 3, 4), targets, decay=0.8, normalizer=1.0, base_next=torch.zeros(6, 4))


@pytest.mark.parametrize("chunk", [0, 1, 5, 4096])  # 0: the logits held at once; else rows projected per chunk
@pytest.mark.parametrize("target", ["labels", "base_argmax", "soft"])
@pytest.mark.parametrize("share_lm_head", [False, True])
def test_heads_run_only_where_counted_and_give_the_dense_loss_gradient_and_metrics(target, share_lm_head, chunk):
    from medusa_train.models.heads_base import HeadsSpec
    from medusa_train.drafters.medusa.heads import MedusaHeads
    from medusa_train.training.step import FrozenBase, LossSpec, heads_on_batch

    torch.manual_seed(0)
    V, H, K, T = 12, 8, 3, 9
    token_map = torch.tensor([0, 2, 3, 5, 7, 8, 11])  # a reduced head vocabulary: some targets miss it
    spec = HeadsSpec(num_heads=K, num_layers=1, hidden_size=H, vocab_size=V, share_lm_head=share_lm_head,
                     head_vocab_size=token_map.numel())
    heads = MedusaHeads(spec, token_map)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0, 0.5)
    lm_head = torch.nn.Linear(H, V, bias=False)
    base = FrozenBase(backbone=None, lm_head=lm_head)
    # a padded batch: row 1 is two tokens shorter, prompts (-100) at the start of each row
    labels = torch.randint(0, V, (2, T))
    labels[:, :3] = -100
    labels[1, T - 2 :] = -100
    hidden = torch.randn(2, T, H)
    base_logits = lm_head(hidden).detach()  # soft: the base distributions are the targets
    batch = {"hidden": hidden, "base_argmax": base_logits.argmax(-1), "labels": labels}
    loss_spec = LossSpec(target=target, decay=0.8, share_lm_head=share_lm_head, vocab_size=V, num_heads=K,
                         token_map=token_map, loss_chunk_size=chunk)

    packed = heads_on_batch(heads, base, batch, loss_spec)
    packed.loss.backward()
    packed_grads = [p.grad.clone() for p in heads.parameters()]
    heads.zero_grad()
    dense = heads_loss(heads(batch["hidden"], lm_head.weight if share_lm_head else None), labels,
                             target=target, decay=0.8, base_argmax=batch["base_argmax"], token_map=token_map,
                             vocab_size=V, base_logits=base_logits if target == "soft" else None)
    dense.loss.backward()

    # row 0 is labelled at 3..8, row 1 at 3..6: head k counts t when t + k + 2 is labelled, so positions 0..6 of
    # row 0 and 0..4 of row 1 are counted by some head; head 0 counts 6 + 4, head 1 6 + 4, head 2 5 + 3
    assert packed.count.tolist() == dense.count.tolist() == [10, 10, 8]
    assert packed.correct_top1.tolist() == dense.correct_top1.tolist()
    assert packed.correct_top5.tolist() == dense.correct_top5.tolist()
    assert packed.loss.item() == pytest.approx(dense.loss.item(), rel=1e-6)
    for got, param in zip(packed_grads, heads.parameters()):  # chunks sum the same terms in another order
        assert torch.allclose(got, param.grad, rtol=1e-5, atol=1e-6 if chunk else 1e-7)


# ---- training on a tiny model -------------------------------------------------------------------------------------

def test_training_reduces_head_loss_and_the_export_loads(tiny_inputs, tmp_path):
    from medusa_train.training.head_accuracy import head_accuracy

    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", **{"trainer.max_steps": 30})))
    recipe.setup()
    before = head_accuracy(recipe.trainer.model, recipe.frozen_base, recipe.eval_set, recipe.collator,
                           recipe.loss_spec, 8, "cpu")
    recipe.train()
    export_dir = recipe.save()
    recipe.cleanup()
    after = recipe.summary["accuracy"]
    assert after["positions"] == before["positions"] and min(after["positions"]) > 50
    for k in range(2):
        assert after["loss"][k] < 0.5 * before["loss"][k]
        assert after["top1"][k] > before["top1"][k] + 0.2
    assert recipe.trainer.model.block_weight.requires_grad and recipe.summary["global_step"] == 30
    assert all(not p.requires_grad for p in recipe.base.parameters())
    assert {id(p) for g in recipe.trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in recipe.trainer.model.parameters()}
    # the export holds exactly the trained heads, and the accuracy table printed at the end
    loaded, config = load_heads(export_dir, base_model=recipe.base)
    for name, tensor in recipe.trainer.model.state_dict().items():
        torch.testing.assert_close(getattr(loaded, name), tensor)
    assert config["medusa_num_heads"] == 2 and config["training"]["global_step"] == 30
    data = config["training"]["data"]  # the data's counts, labelled tokens for the data-scaling table
    assert data["labelled_tokens"] == recipe.data.stats.label_tokens > 0 and data["tokens"] > data["labelled_tokens"]
    assert (data["train_conversations"], data["eval_conversations"]) == (len(recipe.data.train), 4)
    assert config["training"]["train_runtime_s"] > 0 and config["training"]["resumed_from"] is None
    assert set(config["training"]["load_average"]) == {"before", "after"}
    table = json.loads((export_dir / "train_head_accuracy.json").read_text())
    assert table["top1"] == after["top1"] and table["conversations"] == 4 and table["split"] == "eval"
    logged = [entry for entry in recipe.trainer.state.log_history if "head0/loss" in entry]
    assert len(logged) == 15 and logged[-1]["head0/loss"] < logged[0]["head0/loss"]
    assert {"head1/top1", "head1/top5", "tokens_per_second"} <= set(logged[0])


def test_hidden_cache_trains_the_same_heads_as_the_base_pass(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    target = {"heads.target": "base_argmax"}
    plain = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "plain", **target)))
    cached = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "cached", hidden_cache="true",
                                                      **target)))
    plain.run()
    cached.run()
    assert sorted(p.name for p in (tmp_path / "cached" / "hidden_cache").glob("*.safetensors")) == [
        "eval-block-000000.safetensors", "train-block-000000.safetensors"]
    assert cached.frozen_base.backbone is None  # the Trainer never ran the base
    assert_same_heads(exported_heads(tmp_path / "plain" / "export"), exported_heads(tmp_path / "cached" / "export"))
    assert plain.summary["accuracy"]["top1"] == pytest.approx(cached.summary["accuracy"]["top1"], abs=0.01)


class CrashAtStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def test_crashed_run_resumes_from_the_last_complete_checkpoint_to_the_same_heads(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "whole"))).run()
    run = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, run)), callbacks=[CrashAtStep(6)]).run()
    ckpts = run / "checkpoints"
    assert [p.name for p in sorted(ckpts.iterdir())] == ["checkpoint-4"]
    # a save killed half-way: the files of step 8 without the completeness marker
    shutil.copytree(ckpts / "checkpoint-4", ckpts / "checkpoint-8")
    (ckpts / "checkpoint-8" / checkpoints.COMPLETE_MARKER).unlink()
    resumed = build_recipe(compose_train(tiny_overrides(model_dir, data, run, resume="true")))
    resumed.run()
    assert resumed.summary["resumed_from"] == str(ckpts / "checkpoint-4")
    assert resumed.summary["global_step"] == 8
    assert_same_heads(exported_heads(tmp_path / "whole" / "export"), exported_heads(run / "export"))
    assert checkpoints.incomplete_reason(ckpts / "checkpoint-8") is None  # rewritten, complete this time


def test_a_cache_block_damaged_in_place_is_rebuilt_with_a_warning_on_resume_and_the_heads_are_a_clean_runs(
        tiny_inputs, tmp_path, caplog):
    model_dir, data = tiny_inputs
    cache = {"hidden_cache": "true", "heads.target": "base_argmax"}
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "clean", **cache))).run()
    run = tmp_path / "damaged"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, run, **cache)), callbacks=[CrashAtStep(6)]).run()
    block = run / "hidden_cache" / "train-block-000000.safetensors"
    sealed = json.loads(block.with_suffix(".json").read_text())["sha256"]
    damaged = bytearray(block.read_bytes())
    middle = len(damaged) // 2
    damaged[middle : middle + 64] = bytes(b ^ 0xFF for b in damaged[middle : middle + 64])  # same size
    block.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.hidden_cache"):
        resumed = build_recipe(compose_train(tiny_overrides(model_dir, data, run, resume="true", **cache)))
        resumed.run()
    assert f"hidden cache: {block} is damaged: its sha256 differs from the one sealed" in caplog.text
    assert file_sha256(block) == sealed == file_sha256(tmp_path / "clean" / "hidden_cache" / block.name)  # rebuilt
    assert resumed.summary["resumed_from"] == str(run / "checkpoints" / "checkpoint-4")
    assert_same_heads(exported_heads(tmp_path / "clean" / "export"), exported_heads(run / "export"), atol=0)


# ---- checkpoints --------------------------------------------------------------------------------------------------

def test_checkpoint_marker_detects_interrupted_and_damaged_saves(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        folder = root / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * step)
        (folder / "trainer_state.json").write_text("{}")
    checkpoints.mark_complete(root / "checkpoint-2", 2)
    checkpoints.mark_complete(root / "checkpoint-4", 4)
    assert "interrupted" in checkpoints.incomplete_reason(root / "checkpoint-6")
    assert checkpoints.latest_complete(root) == root / "checkpoint-4"
    (root / "checkpoint-4" / "model.safetensors").write_bytes(b"x")  # truncated after the save
    assert "1 bytes, 4 when saved" in checkpoints.incomplete_reason(root / "checkpoint-4")
    assert checkpoints.latest_complete(root) == root / "checkpoint-2"
    assert checkpoints.remove_incomplete(root) == [root / "checkpoint-4", root / "checkpoint-6"]
    assert [p.name for p in root.iterdir()] == ["checkpoint-2"]


def test_rotation_keeps_the_newest_complete_checkpoints_and_never_an_incomplete_one(tmp_path):
    for step in (1, 2, 3, 4):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "f").write_text("x")
        if step != 4:
            checkpoints.mark_complete(folder, step)
    assert checkpoints.rotate(tmp_path, keep=2) == [tmp_path / "checkpoint-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert checkpoints.rotate(tmp_path, keep=None) == []


# ---- bad input, found before training -----------------------------------------------------------------------------

def test_conversations_without_assistant_turns_fail_before_training(tiny_inputs, tmp_path):
    model_dir, _ = tiny_inputs
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}] * 3)
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run")))
    with pytest.raises(ValueError, match="no conversation with an assistant turn"):
        recipe.setup()
    recipe.cleanup(failed=True)
    assert recipe.trainer is None and not (tmp_path / "run" / "checkpoints").exists()


def test_empty_data_file_fails_before_training(tiny_inputs, tmp_path):
    model_dir, _ = tiny_inputs
    (tmp_path / "empty.jsonl").write_text("")
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, tmp_path / "empty.jsonl", tmp_path / "run")))
    with pytest.raises(ValueError, match="is empty"):
        recipe.setup()
    recipe.cleanup(failed=True)


def test_conversations_longer_than_max_length_are_truncated_with_a_count(tiny_inputs, tmp_path, caplog):
    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", max_length=56)))
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.data_prep"):
        recipe.setup()
    recipe.cleanup()
    lengths = [len(r) for r in recipe.data.train["input_ids"]] + [len(r) for r in recipe.data.eval["input_ids"]]
    cut = sum(n == 56 for n in lengths)
    # two conversations equal in their first 56 tokens are one training row: the copy is skipped as a duplicate
    kept = len(lengths)
    assert max(lengths) == 56 and 0 < cut < kept and recipe.data.stats.skipped == {"duplicate": 20 - kept}
    assert f"{cut} of {kept} conversations are longer than max_length=56 tokens and were truncated" in caplog.text


def test_deepspeed_batch_sizes_are_checked_against_the_trainer_config(tiny_inputs, tmp_path, monkeypatch):
    trainer = TrainerConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    check_deepspeed_batch({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"}, trainer, world_size=2)
    with pytest.raises(ValueError, match=r"train_batch_size=12 but .* = 4 \* 2 \* 2 = 16"):
        check_deepspeed_batch({"train_batch_size": 12}, trainer, world_size=2)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=8 but trainer.per_device_train_batch_size=4"):
        check_deepspeed_batch({"train_micro_batch_size_per_gpu": 8}, trainer, world_size=1)
    # through the recipe: fails in check(), before a process group or a model exists
    model_dir, data = tiny_inputs
    config = json.loads((CONF_DIR / "deepspeed" / "zero2.json").read_text())
    config["train_batch_size"] = 7
    (tmp_path / "ds.json").write_text(json.dumps(config))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", trainer="deepspeed_zero2",
                                                      **{"trainer.deepspeed": str(tmp_path / "ds.json")})))
    with pytest.raises(ValueError, match="gradient_accumulation_steps \\* world_size = 4 \\* 1 \\* 2 = 8"):
        recipe.check()
    assert not (tmp_path / "run").exists()


def test_single_process_trainer_refuses_a_multi_process_launch(tiny_inputs, tmp_path, monkeypatch):
    model_dir, data = tiny_inputs
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run")))
    with pytest.raises(ValueError, match="use trainer=ddp"):
        recipe.check()


def test_output_dir_holding_another_run_needs_resume_or_overwrite(tiny_inputs, tmp_path):
    from medusa_train.training.run_dir import RunPaths, prepare_output_dir

    model_dir, data = tiny_inputs
    first = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run")))
    first.check()
    prepare_output_dir(RunPaths(tmp_path / "run"), first.resolved, overwrite=False)
    other = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", seed=7)))
    other.check()  # a run that stopped before its first checkpoint leaves nothing to protect
    (tmp_path / "run" / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    # the seed fixes the data order of the checkpoints: resume=true is not advised, it could not continue with it
    with pytest.raises(ValueError, match=r"differs in seed \(42 -> 7\)\. Use a new output_dir, or overwrite=true"):
        other.check()
    longer = {"trainer.max_steps": 16}
    with pytest.raises(ValueError, match=r"trainer.max_steps \(8 -> 16\)\. Use resume=true.*new output_dir.*overwrite"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", **longer))).check()
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", seed=7, overwrite="true"))).check()
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", resume="true", **longer))).check()
    with pytest.raises(ValueError, match="already holds checkpoints or an export of this run"):
        first.check()


def test_deepspeed_launcher_local_rank_argument_is_moved_out_of_hydras_way(monkeypatch):
    from medusa_train.cli.train import strip_local_rank

    monkeypatch.setenv("LOCAL_RANK", "0")  # restored after the test
    assert strip_local_rank(["medusa-train", "--local_rank=3", "trainer=ddp"]) == ["medusa-train", "trainer=ddp"]
    assert os.environ["LOCAL_RANK"] == "3"
    assert strip_local_rank(["medusa-train", "--local_rank", "1", "seed=3"]) == ["medusa-train", "seed=3"]
    assert os.environ["LOCAL_RANK"] == "1"


@pytest.mark.slow
def test_wandb_logs_per_head_metrics_offline(tiny_inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_TAGS"):
        monkeypatch.delenv(var, raising=False)
    model_dir, data = tiny_inputs
    out = tmp_path / "run"
    overrides = tiny_overrides(model_dir, data, out, logger="wandb", **{"logger.mode": "offline"})
    build_recipe(compose_train(overrides)).run()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    keys = (b"train/head0/top1", b"train/head1/top5", b"train/head1/loss", b"train/tokens_per_second")
    # wandb's service process writes the run file on its own: on a loaded machine it may land after finish() returns
    deadline = time.monotonic() + 60
    while True:
        records = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))  # protobuf records name their keys
        if all(key in records for key in keys) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for key in keys:
        assert key in records


def test_soft_target_shared_lm_head_reduced_vocab_and_periodic_eval_train_and_export(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    out = tmp_path / "run"
    recipe = build_recipe(compose_train(tiny_overrides(
        model_dir, data, out, **{"heads.target": "soft", "heads.share_lm_head": "true", "heads.head_vocab_size": 64,
                                 "+trainer.extra.eval_strategy": "steps", "+trainer.extra.eval_steps": 4})))
    recipe.run()
    heads = recipe.trainer.model
    assert heads.lm_head_weight is None and heads.token_map.shape == (64,)
    # the 64 kept tokens are the most frequent labels: every word of the counting replies is among them
    labels = torch.cat([torch.as_tensor(r) for r in recipe.data.train["labels"]])
    distinct = set(labels[labels >= 0].tolist())
    assert len(distinct) < 64 and distinct <= set(heads.token_map.tolist())
    evals = [e for e in recipe.trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [4, 8] and {"eval_head0/top1", "eval_head1/top5"} <= set(evals[0])
    loaded, config = load_heads(out / "export", base_model=recipe.base)
    assert config["share_lm_head"] is True and config["head_vocab_size"] == 64
    torch.testing.assert_close(loaded.token_map, heads.token_map)
    torch.testing.assert_close(loaded.block_weight, heads.block_weight)


def test_gradient_accumulation_trains_the_same_heads_as_one_larger_batch(tiny_inputs, tmp_path):
    """The loss is divided by the labelled tokens of the whole optimizer step, so 2 micro-batches of 2 rows give the
    gradient of one batch of 4 rows even though the micro-batches hold different numbers of tokens."""
    model_dir, data = tiny_inputs
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "batch4"))).run()
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "accum", **{
        "trainer.per_device_train_batch_size": 2, "trainer.gradient_accumulation_steps": 2}))).run()
    assert_same_heads(exported_heads(tmp_path / "batch4" / "export"), exported_heads(tmp_path / "accum" / "export"))


def test_self_distilled_prompts_are_cached_reused_and_long_prompts_left_out(tiny_inputs, tmp_path, caplog):
    model_dir, _ = tiny_inputs
    prompts = [f"count from {w}" for w in WORDS[:6]] + [" ".join(WORDS * 8)]  # the last is longer than max_length
    overrides = tiny_overrides(model_dir, Path("unused.jsonl"), tmp_path / "run", **{
        "data": "stories260k_selfdistill", "data.prompts": json.dumps(prompts), "data.max_new_tokens": 6,
        "data.eval_fraction": 0.0})
    recipe = build_recipe(compose_train(overrides))
    with caplog.at_level(logging.WARNING):
        recipe.setup()
    recipe.cleanup()
    shard = tmp_path / "run" / "self_distill" / "conversations.block000000.jsonl"  # 7 prompts: one block
    records = sorted((json.loads(line) for line in shard.read_text().splitlines()), key=lambda r: r["source_index"])
    assert [r["conversations"][0]["value"] for r in records] == prompts[:6]
    assert all(r["new_tokens"] <= 6 and r["conversations"][1]["from"] == "gpt" for r in records)
    assert "1 of 7 prompts have no reply" in caplog.text
    assert recipe.data.conversations == 6 and len(recipe.data.train) == 6
    again = build_recipe(compose_train(overrides))
    again.setup()  # nothing trained yet, so the folder is free; the replies are read back, not generated again
    again.cleanup()
    assert shard.read_text().count("\n") == 6
    assert again.data.train["input_ids"] == recipe.data.train["input_ids"]


def test_only_the_exporting_process_keeps_the_gathered_weights():
    # the export's host copy is the main process's alone (70B Medusa-1: about 17 GiB a node, not 8 x that)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)  # a frozen base weight: never gathered
    trainer = types.SimpleNamespace(model=model, is_deepspeed_enabled=False)
    kept = gather_trainable_state(trainer)
    assert sorted(kept) == ["0.bias", "1.bias", "1.weight"]
    assert torch.equal(kept["1.weight"], model[1].weight) and kept["1.weight"].data_ptr() != model[1].weight.data_ptr()
    assert gather_trainable_state(trainer, keep=False) == {}
