"""Medusa-2's two stages in one run (Medusa paper, arXiv:2401.10774, Sec. 2.2.2, "Training strategies"): the heads
first train alone on the frozen base (Medusa-1), then base and heads train together starting from those heads, so
that the randomly-initialised heads' large early gradients never reach the base model.

Stage 1 is an ordinary frozen-base run in ``${output_dir}/stage1`` (its own checkpoints, resume and export), derived
from the Medusa-2 config by :func:`stage1_config`; the joint stage then reads ``${output_dir}/stage1/export``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from medusa_train.config.schema import FROZEN_BASE

STAGE1_DIR = "stage1"


def stage1_config(resolved: dict[str, Any], output_dir: Path, self_distill_dir: Path) -> dict[str, Any]:
    """The frozen-base config of stage 1, from the resolved joint config.

    Changes: ``heads.mode=frozen_base`` (stage and init settings cleared), ``hidden_cache`` from
    ``heads.stage1_hidden_cache``, ``trainer.num_train_epochs=heads.stage1_epochs`` (``max_steps`` off),
    ``trainer.learning_rate`` times ``heads.heads_lr_multiplier`` (the heads' rate of the joint stage),
    ``output_dir`` = ``output_dir``, self-distilled data shared with the joint stage (``self_distill_dir``), no vLLM
    files and no publishing.
    """
    cfg = copy.deepcopy(resolved)
    heads = cfg["heads"]
    cfg["hidden_cache"] = bool(heads.get("stage1_hidden_cache", False))
    cfg["hidden_cache_dir"] = None
    cfg["trainer"]["num_train_epochs"] = heads["stage1_epochs"]
    cfg["trainer"]["max_steps"] = -1
    cfg["trainer"]["learning_rate"] = cfg["trainer"]["learning_rate"] * heads["heads_lr_multiplier"]
    heads.update(mode=FROZEN_BASE, stage1_epochs=0.0, init_from=None)
    cfg["data"]["self_distill_dir"] = cfg["data"].get("self_distill_dir") or str(self_distill_dir)
    cfg.update(output_dir=str(output_dir), export=True, export_vllm=False, push_to_hub=False)
    return cfg


def stage1_done(output_dir: Path) -> bool:
    """Stage 1 finished: its export's config.json (written last) is there."""
    return (output_dir / "export" / "config.json").is_file()
