"""Plain autoregressive decoding: one target-model forward pass per token, the baseline every speedup is measured
against. Greedy output equals Hugging Face ``model.generate(do_sample=False)`` token for token.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from inference.decoders.base import (
    DecodeConfig,
    DecodeResult,
    check_context,
    choose_token,
    make_generator,
)
from inference.decoders.batching import Replies, left_pad, prefill_mask, sliding_window
from medusa_train.models.generation import max_positions
from medusa_train.tree.kv_cache import request_cache, select_rows
from medusa_train.tree.masks import additive_mask, positions


@lru_cache(maxsize=None)
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def vanilla_logits(
    model: PreTrainedModel,
    cache: DynamicCache,
    input_ids: Tensor,
    position_ids: Tensor,
    attention_mask: Tensor | None,
) -> Tensor:
    """One forward pass over ``input_ids`` on top of ``cache`` (which it extends); the logits of each row's last
    position, ``[B, V]`` in the model's dtype. Arguments as :func:`vanilla_step`."""
    kwargs: dict[str, Any] = {"cache": cache, "use_cache": True, "position_ids": position_ids,
                              "attention_mask": attention_mask}
    if _takes_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = 1  # the lm_head over the last position only
    return model(input_ids=input_ids, **kwargs).logits[:, -1, :]


def vanilla_step(
    model: PreTrainedModel,
    cache: DynamicCache,
    input_ids: Tensor,
    position_ids: Tensor,
    attention_mask: Tensor | None,
    config: DecodeConfig,
    generator: torch.Generator | None,
) -> Tensor:
    """One forward pass over ``input_ids`` on top of ``cache`` (which it extends), and the next token of each row.

    Args:
        model: a ``*ForCausalLM``.
        cache: the KV cache of the tokens before ``input_ids``; updated in place.
        input_ids: long ``[B, T]`` (the prompts at prefill, then each row's last token, T = 1).
        position_ids: long ``[B, T]``.
        attention_mask: a 4-D additive mask ``[B, 1, T, L + T]`` when rows hold padding, else None (causal).
        config: temperature / top-k / top-p.
        generator: sampling generator.

    Returns:
        long ``[B]``, the next token of each row.
    """
    return choose_token(vanilla_logits(model, cache, input_ids, position_ids, attention_mask), config, generator)


def top2_gaps(logits: Sequence[Tensor]) -> list[float]:
    """The largest minus the second-largest logit of each ``[V]`` (or ``[1, V]``) tensor, in float32."""
    if not logits:
        return []
    top = torch.stack([x.reshape(-1) for x in logits]).float().topk(2, dim=-1).values  # [T, 2]
    return (top[:, 0] - top[:, 1]).tolist()


class VanillaDecoder:
    """Greedy or sampled decoding, one token per forward pass, on a KV cache written in place
    (:func:`medusa_train.tree.kv_cache.request_cache`; transformers' ``DynamicCache`` for sliding-window models).

    Args:
        model: a ``*ForCausalLM`` (a :class:`~medusa_train.models.speculative.SpeculativeModel` is accepted: its base model is used).
        tokenizer: optional; needed for ``stop_strings`` and to fill :attr:`DecodeResult.text`.
        record_top2_gaps: fill :attr:`DecodeResult.top2_gaps` in :meth:`generate` (one prompt): each step's logits
            are kept (a reference, no copy) and their top-2 gaps computed after the clock stops, so the timing is
            that of plain decoding.
    """

    name = "vanilla"

    def __init__(self, model: Any, tokenizer: Any = None, record_top2_gaps: bool = False) -> None:
        base = getattr(model, "base", model)
        if not isinstance(base, PreTrainedModel):
            raise TypeError(f"VanillaDecoder needs a transformers *ForCausalLM, got {type(model).__name__}")
        self.model = base
        self.tokenizer = tokenizer
        self.record_top2_gaps = record_top2_gaps

    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode one reply (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: empty prompt, batch > 1, prompt + ``max_new_tokens`` beyond ``max_position_embeddings``,
                or ``stop_strings`` without a tokenizer.
        """
        if isinstance(input_ids, Tensor) and input_ids.ndim == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"input_ids has batch {input_ids.shape[0]}; generate takes one prompt ([1, T]), "
                             "generate_batch several")
        return self._decode([input_ids], config, streamer, self.record_top2_gaps)[0]

    def generate_batch(self, prompts: Sequence[Tensor | Sequence[int]], config: DecodeConfig) -> list[DecodeResult]:
        """Decode one reply per prompt in one batch (left-padded; finished rows leave the batch).

        Each row's tokens are those :meth:`generate` gives for its prompt alone (up to floating-point rounding of
        batched kernels). ``wall_time_s`` and ``prefill_time_s`` of every result are the whole batch's; no
        ``top2_gaps``.

        Raises:
            ValueError: as :meth:`generate`, for any prompt (its index named).
            NotImplementedError: padded prompts on a sliding-window model.
        """
        return self._decode(list(prompts), config, None, False)

    @torch.no_grad()
    def _decode(self, prompts: list, config: DecodeConfig, streamer: Any, record: bool) -> list[DecodeResult]:
        model = self.model
        device = model.get_output_embeddings().weight.device
        ids, valid = left_pad(prompts, device)
        lengths = valid.sum(dim=1)
        limit = max_positions(model.config)
        for length in lengths.tolist():
            check_context(length, config.max_new_tokens, limit)
        padded = not bool(valid.all())
        if padded and sliding_window(model.config) is not None:
            raise NotImplementedError("padded batches on a sliding-window model: decode these prompts one at a time")
        replies = Replies(len(prompts), config, self.tokenizer, streamer)
        generator = None if config.greedy else make_generator(config, device)
        kept_logits: list[Tensor] = []

        start = time.perf_counter()
        replies.feed.start(ids)
        cache = request_cache(model.config, ids.shape[1] + config.max_new_tokens)
        logits = vanilla_logits(model, cache, ids, positions(valid), prefill_mask(valid, model.dtype))
        token = choose_token(logits, config, generator)
        if record:
            kept_logits.append(logits)
        replies.first(token.tolist())
        prefill_time = time.perf_counter() - start
        past_valid, next_position = valid, lengths
        one = torch.ones(1, 1, dtype=torch.bool, device=device)
        while True:
            keep = replies.prune()
            if not replies.active:
                break
            if keep is not None:
                keep = keep.to(device)
                select_rows(cache, keep)
                token, past_valid, next_position = token[keep], past_valid[keep], next_position[keep]
            mask = additive_mask(past_valid, one, model.dtype) if padded else None  # [B, 1, 1, L + 1]
            logits = vanilla_logits(model, cache, token[:, None], next_position[:, None], mask)
            token = choose_token(logits, config, generator)
            if record:
                kept_logits.append(logits)
            replies.step([[t] for t in token.tolist()])
            if padded:
                past_valid = torch.cat([past_valid, one.expand(past_valid.shape[0], 1)], dim=1)
            next_position = next_position + 1
        results = replies.results(lengths.tolist(), time.perf_counter() - start, prefill_time)
        if record:
            results[0].top2_gaps = top2_gaps(kept_logits)[: len(results[0].tokens)]
        return results
