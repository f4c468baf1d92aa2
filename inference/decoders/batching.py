"""What decoding several prompts at once needs, shared by the decoders: left padding, the prompt pass's mask, and the
per-row reply bookkeeping (stops, counts, streaming). The 4-D masks and positions of rows whose caches hold holes
are the tree core's (:mod:`medusa_train.tree.masks`), which drafters read too. With one prompt there are no holes
and no mask is needed beyond the model's own causal one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from inference.decoders.base import DecodeConfig, DecodeResult, prompt_tensor
from inference.decoders.stopping import StopCondition
from inference.decoders.streaming import StreamFeed
from medusa_train.tree.masks import additive_mask


def left_pad(prompts: Sequence[Tensor | Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Stack prompts of different lengths, padded on the left.

    Returns:
        ``(input_ids, valid)``: long ``[B, T]`` (padding holds token 0, never attended) and bool ``[B, T]``.

    Raises:
        ValueError: no prompts, or a prompt that :func:`~inference.decoders.base.prompt_tensor` refuses (the index
            is named).
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    rows = []
    for i, p in enumerate(prompts):
        try:
            rows.append(prompt_tensor(p, device)[0])
        except ValueError as e:
            if len(prompts) == 1:
                raise
            raise ValueError(f"prompts[{i}]: {e}") from e
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():] = r
        valid[i, width - r.numel():] = True
    return ids, valid


def prefill_mask(valid: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The prompt pass's mask: causal over real tokens; None when nothing is padded (the model's own mask is used).

    Padding query rows see themselves only, so no softmax row is empty (their outputs are never used).
    """
    if bool(valid.all()):
        return None
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    allowed = (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=valid.device)
    no_past = valid[:, :0]
    return additive_mask(no_past, allowed, dtype)


def sliding_window(config: Any) -> int | None:
    """The sliding-window length every layer uses, or None for full attention.

    Raises:
        NotImplementedError: layers of different attention kinds (e.g. Gemma-2's sliding/full alternation): one
            custom 4-D mask cannot express per-layer windows.
    """
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        raise NotImplementedError(
            f"layer types {sorted(kinds)}: a custom 4-D attention mask (tree attention, padded batches) applies to "
            "every layer and cannot reproduce per-layer sliding windows; decode one prompt with the vanilla decoder"
        )
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        return int(window)
    return None


class Replies:
    """Per-row reply bookkeeping: stop rules, kept tokens, accepted lengths, stop reasons, and which rows still decode.

    Args:
        count: B, the number of prompts.
        config: the request (stop rules).
        tokenizer: for stop strings and ``text`` (optional).
        streamer: fed with row 0's tokens; only allowed with one prompt.

    Raises:
        ValueError: a streamer with more than one prompt, or stop strings without a tokenizer.
    """

    def __init__(self, count: int, config: DecodeConfig, tokenizer: Any = None, streamer: Any = None) -> None:
        if streamer is not None and count != 1:
            raise ValueError("a streamer needs a single prompt; decode one prompt at a time to stream")
        self.stop = StopCondition(config, tokenizer)
        self.tokenizer = tokenizer
        self.feed = StreamFeed(streamer)
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.accepted: list[list[int]] = [[] for _ in range(count)]
        self.reasons: list[str | None] = [None] * count
        self.active: list[int] = list(range(count))  # prompt index of each row still in the batch

    def first(self, tokens: Sequence[int]) -> None:
        """Record the prefill's token of every active row."""
        for row, token in zip(self.active, tokens):
            self.tokens[row], self.reasons[row] = self.stop.cut([], [token])
            self.feed.put(self.tokens[row])

    def step(self, emitted: Sequence[Sequence[int]]) -> None:
        """Record one decoding pass: ``emitted[i]`` are the tokens active row i produced."""
        for row, new in zip(self.active, emitted):
            kept, self.reasons[row] = self.stop.cut(self.tokens[row], new)
            self.tokens[row] += kept
            self.accepted[row].append(len(kept))
            self.feed.put(kept)

    def prune(self) -> Tensor | None:
        """Drop finished rows; returns the batch positions (long ``[B']``) of the rows kept, or None if all are kept."""
        keep = [i for i, row in enumerate(self.active) if self.reasons[row] is None]
        if len(keep) == len(self.active):
            return None
        self.active = [self.active[i] for i in keep]
        return torch.tensor(keep, dtype=torch.long)

    def results(self, prompt_lengths: Sequence[int], wall_time_s: float, prefill_time_s: float,
                draft_time_s: float | None = None, verify_time_s: float | None = None) -> list[DecodeResult]:
        """One :class:`DecodeResult` per prompt (times are the whole batch's)."""
        self.feed.end()
        return [
            DecodeResult(
                tokens=self.tokens[i],
                accepted_lengths=self.accepted[i],
                forward_passes=len(self.accepted[i]),
                wall_time_s=wall_time_s,
                prefill_time_s=prefill_time_s,
                stop_reason=str(self.reasons[i]),
                prompt_tokens=int(prompt_lengths[i]),
                draft_time_s=draft_time_s,
                verify_time_s=verify_time_s,
                text=None if self.tokenizer is None
                else self.tokenizer.decode(self.tokens[i], skip_special_tokens=True),
            )
            for i in range(len(self.tokens))
        ]
