"""``base_placement``: the rule that picks replicated or ZeRO-3 (pure), the checks that refuse what ZeRO-3 cannot run,
and 2 ranks on the CPU (gloo, torchrun) training Medusa-1 heads from the hidden cache over a base partitioned by
ZeRO-3: each rank holds half of the base, drops its backbone once the cache is built, and the heads come out as a
replicated base trains them."""

from __future__ import annotations

import re

import pytest
import torch

from medusa_train.config.schema import DataConfig, HeadsConfig, TrainConfig
from medusa_train.training.base_placement import (
    REPLICATED,
    ZERO3,
    check_base_placement,
    partition_numel,
    release_backbone,
    resolve_base_placement,
)
from medusa_train.training.recipe import build_recipe
from tests.conftest import make_tiny_model
from tests.medusa_train.test_distributed import RANK_BATCH, check_ok, launch
from tests.medusa_train.test_training import (
    assert_same_heads,
    compose_train,
    exported_heads,
    tiny_overrides,
    write_tiny_inputs,
)


def config(**fields: object) -> TrainConfig:
    heads = fields.pop("heads", HeadsConfig())
    data = fields.pop("data", DataConfig(source="json", path="x.jsonl"))
    return TrainConfig(heads=heads, data=data, output_dir="out", **fields)


@pytest.mark.parametrize("world_size, trainer_zero3, fits, expected", [
    (2, True, True, ZERO3),  # a ZeRO-3 trainer: the base is partitioned too
    (2, False, False, ZERO3),  # the base does not fit one device
    (2, False, True, REPLICATED),
    (1, True, False, REPLICATED),  # nothing to partition over
])
def test_auto_placement_with_the_hidden_cache(world_size, trainer_zero3, fits, expected):
    cfg = config(hidden_cache=True)
    assert resolve_base_placement(cfg, world_size=world_size, trainer_zero3=trainer_zero3, fits=fits) == expected


def test_auto_placement_stays_replicated_where_zero3_cannot_run_in_lockstep():
    no_cache = config()  # Medusa-1 without the cache runs the base on the main process alone (accuracy table)
    hf_distill = config(hidden_cache=True, data=DataConfig(source="json", path="x.jsonl", self_distill=True))
    for cfg in (no_cache, hf_distill):
        assert resolve_base_placement(cfg, world_size=8, trainer_zero3=True, fits=False) == REPLICATED
    joint = config(heads=HeadsConfig(mode="joint"))
    assert resolve_base_placement(joint, world_size=8, trainer_zero3=True, fits=True) == ZERO3
    assert resolve_base_placement(joint, world_size=8, trainer_zero3=False, fits=False) == REPLICATED


def test_explicit_placement_is_taken_as_given():
    assert resolve_base_placement(config(base_placement=REPLICATED, hidden_cache=True), world_size=8,
                                  trainer_zero3=True, fits=False) == REPLICATED
    assert resolve_base_placement(config(base_placement=ZERO3, hidden_cache=True), world_size=1,
                                  trainer_zero3=False, fits=True) == ZERO3


@pytest.mark.parametrize("cfg, trainer_zero3, field", [
    (config(base_placement=ZERO3), False, "hidden_cache=true"),
    (config(base_placement=ZERO3, hidden_cache=True,
            data=DataConfig(source="json", path="x.jsonl", self_distill=True)), False, "data.self_distill_engine"),
    (config(base_placement=ZERO3, heads=HeadsConfig(mode="joint")), False, "trainer=deepspeed_zero3"),
])
def test_zero3_that_cannot_run_is_refused_naming_the_fix(cfg, trainer_zero3, field):
    with pytest.raises(ValueError, match="base_placement=zero3") as e:
        check_base_placement(cfg, trainer_zero3)
    assert field in str(e.value)
    check_base_placement(config(base_placement=ZERO3, hidden_cache=True), False)  # this one runs


def test_release_backbone_keeps_only_lm_head_and_input_embeddings():
    torch.manual_seed(0)
    base = make_tiny_model("llama", vocab_size=512)
    lm_head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    ids = torch.tensor([[3, 5, 7]])
    expected = lm_head(embed(ids))
    release_backbone(base)
    assert partition_numel(base) == (2 * 512 * 32, 2 * 512 * 32)  # [V, H] each, nothing of the layers
    assert base.get_output_embeddings() is lm_head and base.get_input_embeddings() is embed
    torch.testing.assert_close(base.get_output_embeddings()(base.get_input_embeddings()(ids)), expected)
    with pytest.raises(Exception):
        base(ids)


# ---- 2 ranks, gloo ---------------------------------------------------------------------------------------------------

def logged(pattern: str, text: str) -> dict[int, tuple[int, ...]]:
    """rank -> the integers ``pattern`` captures after the rank, from every matching log line."""
    return {int(m.group(1)): tuple(map(int, m.groups()[1:])) for m in re.finditer(pattern, text)}


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_base_two_ranks_train_the_same_heads_as_a_replicated_base(tmp_path):
    """trainer=ddp with base_placement=zero3: each rank loads half of the base (ZeRO-3 partitions, every parameter
    split), builds its half of the hidden cache in lockstep (16 train rows at 8 per forward: one forward each; eval 4
    rows), then holds the lm_head and input embeddings only; the heads equal those of one process over a replicated
    base (fp32)."""
    model_dir, data = write_tiny_inputs(tmp_path)
    single = tmp_path / "single"
    build_recipe(compose_train(tiny_overrides(model_dir, data, single, hidden_cache="true"))).run()
    out = tmp_path / "zero3"
    result = launch(["trainer=ddp", *tiny_overrides(model_dir, data, out, hidden_cache="true", base_placement="zero3",
                                                    **RANK_BATCH)])
    check_ok(result)
    logs = (out / "hydra" / "train-rank0.log").read_text()  # other ranks log warnings only
    assert "base placement: zero3 (base_placement=zero3)" in logs
    total = sum(p.numel() for p in make_tiny_model("llama", vocab_size=512).parameters())
    (mine, whole), = logged(r"rank (\d) holds (\d+) of the base's (\d+) parameters", logs).values()
    assert whole == total and abs(mine - total / 2) <= 64, (mine, total)  # each parameter split in two (+ padding)
    # lm_head [V, H] and embed_tokens [V, H], whole; nothing of the decoder layers
    assert logged(r"rank (\d) keeps (\d+) of its parameters", logs) == {0: (2 * 512 * 32,)}
    assert_same_heads(exported_heads(single / "export"), exported_heads(out / "export"))


@pytest.mark.distributed
@pytest.mark.slow
def test_auto_placement_partitions_the_base_under_a_zero3_trainer(tmp_path):
    """trainer=deepspeed_zero3 with the hidden cache: base_placement=auto picks zero3, two ZeRO-3 engines (the frozen
    base's, without optimizer, and the Trainer's over the heads) live side by side, with more cached rows on one
    rank than on the other (one block of rows for rank 0, none for rank 1: it makes up the forwards it lacks)."""
    model_dir, data = write_tiny_inputs(tmp_path, conversations=21)
    out = tmp_path / "auto"
    result = launch(["trainer=deepspeed_zero3", *tiny_overrides(model_dir, data, out, hidden_cache="true",
                                                                **{**RANK_BATCH,
                                                                   "trainer.per_device_eval_batch_size": 2})])
    check_ok(result)
    logs = (out / "hydra" / "train-rank0.log").read_text()
    assert "base placement: zero3 (base_placement=auto: 2 ranks and the trainer is DeepSpeed ZeRO-3)" in logs
    assert list(logged(r"rank (\d) holds (\d+) of the base's", logs)) == [0]
    assert (out / "export" / "medusa_lm_head.safetensors").is_file()
    # one block of each split (fewer rows than a block): rank 0 built both, rank 1 ran only padding forwards
    blocks = sorted(p.name for p in (out / "hidden_cache").glob("*-block-*.json"))
    assert blocks == ["eval-block-000000.json", "train-block-000000.json"], blocks
