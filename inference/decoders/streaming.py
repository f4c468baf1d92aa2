"""Feeding a streamer as the reply is decided.

Our own streamers follow :class:`inference.decoders.base.TokenStreamer`: ``put(list[int])`` with each step's kept
new tokens (never the prompt), then ``end()``. A Hugging Face ``BaseStreamer`` (``TextStreamer``,
``TextIteratorStreamer``) is driven the way ``model.generate`` drives it (transformers 5.24,
``generation/utils.py``): ``put`` once with the prompt ids as a ``[1, T]`` tensor (which ``skip_prompt=True``
drops), then ``put`` with each step's new ids as a 1-D long tensor, then ``end()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.generation.streamers import BaseStreamer


class StreamFeed:
    """Adapts any supported streamer (or None) to ``start(prompt)``, ``put(token_ids)`` and ``end()``.

    Raises:
        TypeError: ``streamer`` has no ``put``/``end`` methods.
    """

    def __init__(self, streamer: Any) -> None:
        if streamer is not None and not (callable(getattr(streamer, "put", None))
                                         and callable(getattr(streamer, "end", None))):
            raise TypeError(f"streamer must have put() and end() methods, got {type(streamer).__name__}")
        self.streamer = streamer
        self.hf = isinstance(streamer, BaseStreamer)

    def start(self, prompt: Tensor) -> None:
        """Announce the prompt (long ``[1, T]``); only Hugging Face streamers receive it."""
        if self.hf:
            self.streamer.put(prompt.detach().cpu())

    def put(self, token_ids: list[int]) -> None:
        """Send one step's kept new tokens (nothing is sent for an empty list)."""
        if self.streamer is None or not token_ids:
            return
        self.streamer.put(torch.tensor(token_ids, dtype=torch.long) if self.hf else list(token_ids))

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
