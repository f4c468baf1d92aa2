"""When a reply ends: EOS, a stop string, or ``max_new_tokens``, checked on the tokens each decoding step adds.

A step may emit several tokens at once (speculative decoders); :meth:`StopCondition.cut` keeps the step's tokens up
to and including the first one that ends the reply, so every decoder truncates the same way and never returns more
than ``max_new_tokens`` tokens. The stopping token itself (EOS, the token completing a stop string) is kept, as in
Hugging Face ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference.decoders.base import DecodeConfig

EOS, STOP_STRING, MAX_NEW_TOKENS = "eos", "stop_string", "max_new_tokens"


class StopCondition:
    """The end-of-reply rules of one request.

    Args:
        config: ``eos_token_ids``, ``stop_strings`` and ``max_new_tokens``.
        tokenizer: any object with ``decode(list[int]) -> str``; needed only with ``stop_strings``.

    Raises:
        ValueError: ``stop_strings`` given without a tokenizer.
    """

    def __init__(self, config: DecodeConfig, tokenizer: Any = None) -> None:
        if config.stop_strings and tokenizer is None:
            raise ValueError(
                f"stop_strings={list(config.stop_strings)} needs a tokenizer: build the decoder with tokenizer=..."
            )
        self.eos = frozenset(config.eos_token_ids)
        self.stop_strings = config.stop_strings
        self.max_new_tokens = config.max_new_tokens
        self.tokenizer = tokenizer

    def _has_stop_string(self, tokens: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(tokens))
        return any(s in text for s in self.stop_strings)

    def cut(self, tokens: Sequence[int], new: Sequence[int]) -> tuple[list[int], str | None]:
        """Which of a step's new tokens to keep, and why the reply ends (None: it goes on).

        Args:
            tokens: the reply so far (which did not end).
            new: the tokens this step emitted, in order.

        Returns:
            ``(kept, reason)``: ``kept`` is ``new`` up to and including the first token that ends the reply;
            ``reason`` is ``"eos"``, ``"stop_string"``, ``"max_new_tokens"`` or None.
        """
        room = self.max_new_tokens - len(tokens)
        end, reason = len(new), None
        for i, token in enumerate(new):
            if token in self.eos:
                end, reason = i + 1, EOS
                break
        if room <= end and (reason is None or room < end):
            end, reason = room, MAX_NEW_TOKENS
        if self.stop_strings and end > 0 and self._has_stop_string([*tokens, *new[:end]]):
            # The reply so far had no stop string: find the first new token that completes one.
            for i in range(end):
                if self._has_stop_string([*tokens, *new[: i + 1]]):
                    return list(new[: i + 1]), STOP_STRING
        return list(new[:end]), reason
