"""``trainer=auto``, the default: the ddp preset with CUDA, the cpu preset without, overrides on top, and the
choice logged."""

from __future__ import annotations

import logging

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from medusa_train.config.auto_trainer import auto_trainer, log_choice
from medusa_train.cli.train import register_schemas
from medusa_train.files.paths import CONF_DIR

register_schemas()


def composed_trainer(overrides: list[str]) -> tuple[dict, str]:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/runs/x", *overrides], return_hydra_config=True)
    return OmegaConf.to_container(cfg.trainer), cfg.hydra.runtime.choices.trainer


def preset(name: str) -> dict:
    return composed_trainer([f"trainer={name}"])[0]


@pytest.mark.parametrize(("cuda", "expected"), [(True, "ddp"), (False, "cpu")])
def test_auto_is_the_default_and_composes_the_gpu_or_the_cpu_preset(monkeypatch, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8 if cuda else 0)
    trainer, choice = composed_trainer([])
    assert choice == "auto"
    assert trainer == preset(expected)
    assert trainer["strategy"] == {"ddp": "ddp", "cpu": "single"}[expected]
    assert auto_trainer() == (expected, "CUDA is available (8 GPUs)" if cuda else "CUDA is not available")


def test_overrides_apply_on_top_of_the_chosen_preset_and_a_named_preset_skips_the_rule(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trainer, _ = composed_trainer(["trainer.learning_rate=0.5", "trainer.timeout_minutes=5"])
    assert (trainer["learning_rate"], trainer["timeout_minutes"], trainer["use_cpu"]) == (0.5, 5.0, True)
    trainer, choice = composed_trainer(["trainer=ddp"])  # no CUDA here, and still the preset asked for
    assert (choice, trainer["strategy"], trainer["precision"]) == ("ddp", "ddp", "bf16")


def test_the_choice_and_its_reason_are_logged(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="medusa_train.config.auto_trainer"):
        log_choice("auto")
        log_choice("cpu")  # a named preset: nothing to explain
    assert [r.getMessage() for r in caplog.records] == [
        "trainer=auto: trainer=cpu, CUDA is not available (name a preset, e.g. trainer=ddp, to choose another)"]
