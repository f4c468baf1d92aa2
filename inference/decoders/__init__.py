"""Decoders behind one interface (:class:`~inference.decoders.base.Decoder`): plain decoding and Medusa.

- :class:`VanillaDecoder`: one target forward pass per token (the baseline).
- :class:`MedusaDecoder`: Medusa heads draft a tree, one target pass verifies it.
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
from inference.decoders.medusa import MedusaDecoder, default_medusa_choices, medusa_step
from inference.decoders.vanilla import VanillaDecoder, vanilla_step

__all__ = [
    "DecodeConfig",
    "DecodeResult",
    "Decoder",
    "MedusaDecoder",
    "TokenStreamer",
    "VanillaDecoder",
    "aggregate_mean_accepted_tokens",
    "default_medusa_choices",
    "generate",
    "medusa_step",
    "vanilla_step",
]
