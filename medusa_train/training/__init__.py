"""Medusa training on the HF Trainer: losses, the Trainer subclasses (Medusa-1 heads on a frozen base; Medusa-2 joint
training, :mod:`~medusa_train.training.joint`), hidden-state cache, checkpoints, one recipe per flow.

Entry points: :class:`~medusa_train.training.frozen_base_recipe.FrozenBaseRecipe` and
:class:`~medusa_train.training.joint_recipe.JointRecipe` (``setup`` -> ``train`` -> ``save`` -> ``cleanup``, on
the shared steps of :class:`~medusa_train.training.base_recipe.BaseRecipe`); :func:`~medusa_train.training.recipe.
build_recipe` picks one from ``heads.mode``, as ``medusa_train.cli.train`` (``medusa-train``) does. The recipes and
Trainers are imported on first use, so that ``medusa_train.training.losses`` does not pull in the Trainer.
"""

from __future__ import annotations

from typing import Any

from medusa_train.training.losses import HeadLossOutput, decay_weights, heads_loss, valid_mask

_LAZY = {"build_recipe": "recipe", "BaseRecipe": "base_recipe", "FrozenBaseRecipe": "frozen_base_recipe",
         "JointRecipe": "joint_recipe", "resolve_config": "base_recipe", "DrafterTrainer": "trainer",
         "JointTrainer": "joint_trainer", "JointModel": "joint"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"medusa_train.training.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'medusa_train.training' has no attribute {name!r}")


__all__ = ["BaseRecipe", "HeadLossOutput", "JointModel", "JointTrainer", "FrozenBaseRecipe", "JointRecipe",
           "DrafterTrainer", "build_recipe", "decay_weights", "heads_loss", "resolve_config", "valid_mask"]
