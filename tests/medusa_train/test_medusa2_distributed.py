"""Medusa-2 with LoRA on 2 ranks under DeepSpeed ZeRO-3 (CPU, gloo, torchrun): stage 1 (heads alone) and the joint
stage run in one launch; base and heads are sharded, the run trains, checkpoints its trainable weights and exports the
heads with the merged base."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_train.export import read_export_config
from medusa_train.training.joint import prepare_base
from medusa_train.training.joint import load_trainable_state
from medusa_train.training.joint_trainer import TRAINABLE_FILE
from tests.conftest import make_tiny_model
from tests.medusa_train.test_distributed import RANK_BATCH, check_ok, launch
from tests.medusa_train.test_medusa2 import IDS, joint_overrides, logits_of, lora_heads_config
from tests.medusa_train.test_training import exported_heads, write_tiny_inputs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_zero3_two_ranks_train_lora_and_export_the_merged_base(tmp_path):
    model_dir, data = write_tiny_inputs(tmp_path)
    out = tmp_path / "zero3"
    result = launch(["trainer=deepspeed_zero3",
                     *joint_overrides(model_dir, data, out, **RANK_BATCH, **{"heads.stage1_epochs": 1})])
    check_ok(result)
    assert result.stdout.count("per-head accuracy on the eval split") == 2  # rank 0 only, once per stage
    assert (out / "stage1" / "checkpoints" / "checkpoint-4").is_dir()  # 16 rows, 2 ranks x 2 rows: 4 steps
    assert "joint stage starts from the heads in" in result.stdout + result.stderr
    # the joint stage's base loaded partitioned (base_placement=auto under a ZeRO-3 trainer): half of it on rank 0
    log = (out / "hydra" / "train-rank0.log").read_text()
    assert "base placement: zero3 (base_placement=auto: 2 ranks and the trainer is DeepSpeed ZeRO-3)" in log
    held, total = map(int, re.search(r"rank 0 holds (\d+) of the base's (\d+) parameters", log).groups())
    assert abs(held - total / 2) <= 64, (held, total)
    export = out / "export"
    assert read_export_config(export)["base_model_name_or_path"] == "base"

    # the last checkpoint's trainable weights (gathered from the shards) are the adapters and the heads
    trained = load_file(str(out / "checkpoints" / "checkpoint-8" / TRAINABLE_FILE))
    assert {k.split(".")[0] for k in trained} == {"base", "heads"}
    assert all("lora_" in k for k in trained if k.startswith("base."))
    peft_model = prepare_base(AutoModelForCausalLM.from_pretrained(model_dir).eval(), lora_heads_config())
    load_trainable_state(peft_model, {k.removeprefix("base."): v for k, v in trained.items()
                                      if k.startswith("base.")}, "checkpoint-8")
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert not torch.allclose(logits_of(peft_model, IDS), logits_of(original, IDS), atol=1e-4)  # LoRA trained

    # the exported base is the trained peft model merged, an ordinary HF folder
    merged = AutoModelForCausalLM.from_pretrained(export / "base").eval()
    torch.testing.assert_close(logits_of(merged, IDS), logits_of(peft_model, IDS), atol=1e-5, rtol=1e-5)
    heads = exported_heads(export)
    torch.testing.assert_close(heads["0.0.linear.weight"], trained["heads.block_weight"][0, 0])


def test_zero3_chunked_base_loss_trains_the_same_adapters_and_heads_as_the_logits_held_whole(tmp_path):
    # an untied lm_head (Llama-3.1-70B's) stays partitioned outside its module: the chunked KL loss and argmax
    # gather it for their own forward and backward passes, and train what the [B, T, V] logits train
    model_dir, data = write_tiny_inputs(tmp_path)
    untied = tmp_path / "untied_llama"
    make_tiny_model("llama", seed=0, vocab_size=512, tie_word_embeddings=False).save_pretrained(untied)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(untied)
    trained = {}
    for chunk in (0, 5):
        out = tmp_path / f"chunk{chunk}"
        check_ok(launch(["trainer=deepspeed_zero3", *joint_overrides(
            untied, data, out, **RANK_BATCH, **{"trainer.loss_chunk_size": chunk, "heads.base_loss": "kl",
                                                 "heads.target": "base_argmax", "trainer.max_steps": 4,
                                                 "trainer.save_steps": 4})]))
        trained[chunk] = load_file(str(out / "checkpoints" / "checkpoint-4" / TRAINABLE_FILE))
    assert sorted(trained[5]) == sorted(trained[0])
    assert any("lora_" in name for name in trained[5])
    for name, weight in trained[0].items():  # Adam's 4 steps of 1e-2 amplify rounding: up to 2e-5 seen here
        torch.testing.assert_close(trained[5][name], weight, rtol=1e-3, atol=1e-4)
