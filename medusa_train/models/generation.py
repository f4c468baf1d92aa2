"""Batched greedy generation with HF ``generate``: the base model's own continuations of many prompts at once.

Self-distillation (:mod:`medusa_train.data.self_distill`) and the head-accuracy measurement of tree tuning
(:mod:`inference.tuning.accuracy`) both need the base model's greedy replies to many prompts. Prompts are
left-padded into one batch (``attention_mask`` marks the padding), so one ``generate`` call serves B prompts; on a CPU
batches of prompts of similar length make several times the tokens per second of one prompt at a time
(``benchmarks/self_distill_engines.py`` measures it).
"""

from __future__ import annotations

from typing import Any

import torch


def length_batches(lengths: list[int], batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Group prompt indices into generation batches of similar length, longest first.

    Args:
        lengths: prompt lengths in tokens.
        batch_size: the most prompts per batch (>= 1).
        max_tokens: the most padded prompt tokens per batch (rows x longest prompt), or None; a prompt longer than
            this goes alone. One 3,000-token prompt padded into a batch of 16 short ones would make the batch cost 16
            long prompts.

    Returns:
        Lists of indices into ``lengths``; every index once.

    Raises:
        ValueError: ``batch_size`` < 1 or ``max_tokens`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        current = batches[-1] if batches else None
        fits = current is not None and len(current) < batch_size and (
            max_tokens is None or (len(current) + 1) * lengths[current[0]] <= max_tokens)
        if fits:
            current.append(i)
        else:
            batches.append([i])
    return batches


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id (padding is masked out, so any id works).

    Raises:
        ValueError: the tokenizer has neither a pad nor an EOS token.
    """
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):  # some tokenizers list several EOS ids
            value = value[0] if value else None
        if value is not None:
            return int(value)
    raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id; set tokenizer.pad_token")


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask``, both ``[B, T]`` int64, each prompt right-aligned (T = longest prompt)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def max_positions(config: Any) -> int | None:
    """The model's context length (``max_position_embeddings``; GPT-2's ``n_positions`` maps to it), or None."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


@torch.inference_mode()
def greedy_generate(
    model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids: set[int]
) -> list[tuple[list[int], bool]]:
    """Greedy continuations of B prompts in one left-padded ``generate`` call.

    Args:
        model: a Hugging Face causal LM on its device.
        prompts: B non-empty token-id lists.
        max_new_tokens: the most tokens generated per prompt.
        pad_id: the padding token id.
        stop_ids: token ids that end a continuation (end of turn, EOS); may be empty.

    Returns:
        For each prompt, in order: its new tokens up to and including the first stop id, and whether a stop id
        ended it (False: it ran to ``max_new_tokens``).
    """
    device = getattr(model, "device", None) or next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    generated = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=pad_id, eos_token_id=sorted(stop_ids) or None,
    )
    results = []
    for tokens in generated[:, input_ids.shape[1] :].tolist():  # [B, <= max_new_tokens]
        stop = next((j for j, token in enumerate(tokens) if token in stop_ids), None)
        results.append((tokens, False) if stop is None else (tokens[: stop + 1], True))
    return results
