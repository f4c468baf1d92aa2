"""Decoders behind one interface (:class:`~inference.decoders.base.Decoder`): plain decoding and tree decoding.

- :class:`VanillaDecoder`: one target forward pass per token (the baseline).
- :class:`TreeDecoder`: a tree drafter (any type of the drafter catalog) drafts a tree, one target pass verifies it.
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
from inference.decoders.tree import TreeDecoder, default_medusa_choices, tree_step
from inference.decoders.vanilla import VanillaDecoder, vanilla_step

__all__ = [
    "DecodeConfig",
    "DecodeResult",
    "Decoder",
    "TokenStreamer",
    "TreeDecoder",
    "VanillaDecoder",
    "aggregate_mean_accepted_tokens",
    "default_medusa_choices",
    "generate",
    "tree_step",
    "vanilla_step",
]
