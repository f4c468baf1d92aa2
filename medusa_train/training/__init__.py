"""Medusa training on the HF Trainer: losses, the Trainer subclasses (Medusa-1 heads on a frozen base; Medusa-2 joint
training, :mod:`~medusa_train.training.joint`), hidden-state cache, checkpoints, the recipe.

Entry point: :class:`~medusa_train.training.recipe.TrainRecipe` (``setup`` -> ``train`` -> ``save`` -> ``cleanup``),
wired to the command line by ``medusa_train.cli.train`` (``medusa-train``). ``TrainRecipe`` and ``MedusaTrainer`` are
imported on first use, so that ``medusa_train.training.losses`` does not pull in the Trainer.
"""

from __future__ import annotations

from typing import Any

from medusa_train.training.losses import HeadLossOutput, decay_weights, medusa_head_loss, valid_mask

_LAZY = {"TrainRecipe": "recipe", "resolve_config": "recipe", "MedusaTrainer": "trainer",
         "JointTrainer": "joint_trainer", "JointMedusaModel": "joint"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"medusa_train.training.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'medusa_train.training' has no attribute {name!r}")


__all__ = ["HeadLossOutput", "JointMedusaModel", "JointTrainer", "MedusaTrainer", "TrainRecipe", "decay_weights",
           "medusa_head_loss", "resolve_config", "valid_mask"]
