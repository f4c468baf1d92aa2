"""EAGLE-3 drafters' own settings (``heads.*``, :attr:`medusa_train.models.catalog.DrafterType.options`): the target layers
the drafter fuses. Defined here only; the heads schema holds them (:func:`medusa_train.config.schema.heads_schema`), their
bounds are checked before anything loads, and against the target once it loads
(:func:`~medusa_train.drafters.eagle3.drafter.eagle3_target_fields`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from medusa_train.config.bounds import MAX_COUNT, bound


@dataclass
class Eagle3Options:
    """``heads.*`` of EAGLE-3 drafters.

    Attributes:
        feature_layers: the three target layers fused by the drafter (:mod:`medusa_train.models.features` indices: the input
            of decoder layer i, as vLLM's ``eagle_aux_hidden_state_layer_ids``); None: vLLM's default taps
            ``(2, L // 2, L - 3)`` of an L-layer target.
    """

    feature_layers: Optional[list[int]] = field(default=None, metadata=bound(
        0, cap=MAX_COUNT, hint="target layer indices (the input of layer i); null: vLLM's default taps"))


__all__ = ["Eagle3Options"]
