"""Decoders behind one interface (:class:`~inference.decoders.base.Decoder`): plain decoding and tree decoding.

- :class:`VanillaDecoder`: one target forward pass per token (the baseline).
- :class:`TreeDecoder`: a tree drafter (Medusa or Hydra heads) drafts a tree, one target pass verifies it
  (``MedusaDecoder``: its deprecated name).
- :func:`generate`: a chat reply through any decoder (chat template, EOS ids, text).
"""

from __future__ import annotations

from inference.decoders.base import (
    DecodeConfig,
    DecodeResult,
    Decoder,
    TokenStreamer,
    aggregate_mean_accepted_tokens,
)
from inference.decoders.chat import generate
from inference.decoders.medusa import MedusaDecoder, TreeDecoder, default_medusa_choices, tree_step
from inference.decoders.vanilla import VanillaDecoder, vanilla_step

__all__ = [
    "DecodeConfig",
    "DecodeResult",
    "Decoder",
    "MedusaDecoder",
    "TokenStreamer",
    "TreeDecoder",
    "VanillaDecoder",
    "aggregate_mean_accepted_tokens",
    "default_medusa_choices",
    "generate",
    "tree_step",
    "vanilla_step",
]
