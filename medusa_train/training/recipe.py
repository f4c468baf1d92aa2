"""The training recipes, one per flow, picked from ``heads.mode``.

- ``medusa1``: :class:`~medusa_train.training.medusa1_recipe.Medusa1Recipe`, new heads (Medusa or Hydra) on a
  frozen base;
- ``medusa2``: :class:`~medusa_train.training.medusa2_recipe.Medusa2Recipe`, (a Medusa-1 stage 1, then) the base
  and the heads trained together, exported with the fine-tuned base merged into ``export/base``.

Both run ``setup`` -> ``train`` -> ``save`` -> ``cleanup`` (torchtune's recipe interface) through the steps they
share in :class:`~medusa_train.training.base_recipe.BaseRecipe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig
from transformers import TrainerCallback

from medusa_train.config import TrainConfig
from medusa_train.training.base_recipe import ACCURACY_FILE, BaseRecipe, gather_trainable_state, resolve_config
from medusa_train.training.medusa1_recipe import Medusa1Recipe
from medusa_train.training.medusa2_recipe import Medusa2Recipe

RECIPES: dict[str, type[BaseRecipe]] = {"medusa1": Medusa1Recipe, "medusa2": Medusa2Recipe}  # HEADS_MODES


def build_recipe(cfg: TrainConfig | DictConfig | dict[str, Any],
                 callbacks: Sequence[TrainerCallback] = ()) -> BaseRecipe:
    """The recipe of ``cfg``'s ``heads.mode``: a :class:`Medusa1Recipe` or a :class:`Medusa2Recipe` (arguments as
    :class:`BaseRecipe`).

    Raises:
        ValueError: invalid settings (an unknown ``heads.mode`` among them), found before anything is loaded.
    """
    config, _ = resolve_config(cfg)  # validates heads.mode against HEADS_MODES, the keys of RECIPES
    return RECIPES[config.heads.mode](cfg, callbacks)


__all__ = ["ACCURACY_FILE", "RECIPES", "BaseRecipe", "Medusa1Recipe", "Medusa2Recipe", "build_recipe",
           "gather_trainable_state", "resolve_config"]
