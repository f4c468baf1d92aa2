"""The training recipes, one per flow, picked from ``heads.mode``.

- ``frozen_base``: :class:`~medusa_train.training.frozen_base_recipe.FrozenBaseRecipe`, a new drafter (any type) on
  a frozen base (Medusa-1's recipe);
- ``joint``: :class:`~medusa_train.training.joint_recipe.JointRecipe`, (a frozen-base stage 1, then) the base and
  the heads trained together, exported with the fine-tuned base merged into ``export/base`` (Medusa-2's recipe).

Both run ``setup`` -> ``train`` -> ``save`` -> ``cleanup`` (torchtune's recipe interface) through the steps they
share in :class:`~medusa_train.training.base_recipe.BaseRecipe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig
from transformers import TrainerCallback

from medusa_train.config.schema import FROZEN_BASE, JOINT, TrainConfig
from medusa_train.training.base_recipe import ACCURACY_FILE, BaseRecipe, gather_trainable_state, resolve_config
from medusa_train.training.frozen_base_recipe import FrozenBaseRecipe
from medusa_train.training.joint_recipe import JointRecipe

RECIPES: dict[str, type[BaseRecipe]] = {FROZEN_BASE: FrozenBaseRecipe, JOINT: JointRecipe}  # HEADS_MODES


def build_recipe(cfg: TrainConfig | DictConfig | dict[str, Any],
                 callbacks: Sequence[TrainerCallback] = ()) -> BaseRecipe:
    """The recipe of ``cfg``'s ``heads.mode``: a :class:`FrozenBaseRecipe` or a :class:`JointRecipe` (arguments as
    :class:`BaseRecipe`).

    Raises:
        ValueError: invalid settings (an unknown ``heads.mode`` among them), found before anything is loaded.
    """
    config, _ = resolve_config(cfg)  # validates heads.mode against HEADS_MODES, the keys of RECIPES
    return RECIPES[config.heads.mode](cfg, callbacks)


__all__ = ["ACCURACY_FILE", "RECIPES", "BaseRecipe", "FrozenBaseRecipe", "JointRecipe", "build_recipe",
           "gather_trainable_state", "resolve_config"]
