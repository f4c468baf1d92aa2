"""Medusa-1 head losses: targets for head k at position t, masking, decay weights, per-head metrics.

Source: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024),
Sec. 2.2.1, Eq. (2): ``L = sum_k lambda_k * CE(p_t^(k), y_{t+k+1})`` with 1-based k and ``lambda_k = decay^k``.
Here heads are 0-based: head k reads the last hidden state at t and predicts the token at ``t + k + 2`` (the base
lm_head already predicts ``t + 1``), with weight ``decay ** k``.

Targets (``heads.target``):

- ``labels``: the data token at ``t + k + 2`` (``labels[t + k + 2]``).
- ``base_argmax``: the base model's greedy token for position ``t + k + 2``, i.e. ``argmax base_logits[t + k + 1]``:
  what greedy verification accepts.
- ``soft``: the base distribution ``softmax(base_logits[t + k + 1])``; loss ``KL(p_base || p_head)`` (the cross
  entropy minus the base entropy, so it is 0 when the head matches the base).

A position counts only when its target position ``t + k + 2`` is an assistant (labelled, ``!= -100``) token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
TARGETS = ("labels", "base_argmax", "soft")


@dataclass
class HeadLossOutput:
    """One batch's loss and the sums behind the per-head metrics.

    Attributes:
        loss: scalar float32, ``sum_k decay^k * sum_valid loss_k / normalizer``.
        loss_sum: ``[K]`` float32, head k's unweighted loss summed over its valid positions.
        correct_top1, correct_top5: ``[K]`` float32 counts of valid positions whose target is the head's top-1 /
            among its top-5 tokens (top-5 is top-min(5, V')).
        count: ``[K]`` float32, valid positions per head.
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    correct_top1: torch.Tensor
    correct_top5: torch.Tensor
    count: torch.Tensor


def decay_weights(num_heads: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    """``[K]`` float32 weights ``decay ** k`` for k = 0..K-1 (Medusa uses decay 0.8)."""
    return decay ** torch.arange(num_heads, dtype=torch.float32, device=device)


def valid_mask(labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T]`` labels -> ``[K, B, T]`` bool: head k at t counts when ``t + k + 2 < T`` and ``labels[t + k + 2]``
    is an assistant token (``!= -100``)."""
    T = labels.shape[1]
    mask = torch.zeros((num_heads, *labels.shape), dtype=torch.bool, device=labels.device)
    for k in range(num_heads):
        shift = k + 2
        if shift < T:
            mask[k, :, : T - shift] = labels[:, shift:] != IGNORE_INDEX
    return mask


def target_positions(labels: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices ``(k, b, t)`` of every counted (head, position) pair, each ``[M]`` long, in ``[K, B, T]`` order.

    Head k at position t is counted when ``labels[b, t + k + 2] != -100`` (see :func:`valid_mask`).
    """
    return valid_mask(labels, num_heads).nonzero(as_tuple=True)


def to_head_vocab(token_ids: torch.Tensor, token_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Base token ids (any shape, long) -> head-vocabulary indices; -1 for tokens outside a reduced head vocabulary."""
    if token_map is None:
        return token_ids
    inverse = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
    inverse[token_map.to(token_ids.device)] = torch.arange(token_map.numel(), device=token_ids.device)
    return inverse[token_ids]


def medusa_head_loss(
    head_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    target: str,
    decay: float,
    base_argmax: torch.Tensor | None = None,
    base_logits: torch.Tensor | None = None,
    token_map: torch.Tensor | None = None,
    vocab_size: int | None = None,
    normalizer: torch.Tensor | float | None = None,
) -> HeadLossOutput:
    """The Medusa-1 loss of K heads on one batch, with the sums behind per-head loss and accuracy.

    Args:
        head_logits: ``[K, B, T, V']`` logits of every head at every position (V' = V without ``token_map``).
        labels: ``[B, T]`` long, token ids on assistant turns and -100 elsewhere (not shifted).
        target: ``labels``, ``base_argmax`` or ``soft`` (see the module docstring).
        decay: head k's loss weight is ``decay ** k``.
        base_argmax: ``[B, T]`` long, ``argmax`` of the base logits at each position (``base_argmax``, ``soft``).
        base_logits: ``[B, T, V]`` float base logits (``soft`` only).
        token_map: ``[V']`` long base ids of a reduced head vocabulary; targets outside it are skipped by the loss
            and count as misses in the accuracy.
        vocab_size: V, needed with ``token_map``.
        normalizer: divide the weighted sum by this (e.g. the labelled tokens of the whole optimizer step across
            ranks, so that gradient accumulation and data parallelism give one large batch's gradient); None:
            the number of labelled tokens in ``labels``.

    Returns:
        :class:`HeadLossOutput`. Accuracy targets are the data tokens for ``labels`` and the base argmax for
        ``base_argmax`` and ``soft``.

    Raises:
        ValueError: shapes that do not match, an unknown target, or a target that needs missing base outputs.
    """
    if head_logits.ndim != 4 or head_logits.shape[1:3] != labels.shape:
        raise ValueError(
            f"head_logits must be [K, B, T, V'] with [B, T] = labels.shape {tuple(labels.shape)}, "
            f"got {tuple(head_logits.shape)}"
        )
    if target not in TARGETS:
        raise ValueError(f"heads.target must be one of {TARGETS}, got {target!r}")
    if target != "labels" and base_argmax is None:
        raise ValueError(f"heads.target={target} needs the base model's argmax tokens [B, T]")
    if target == "soft" and base_logits is None:
        raise ValueError("heads.target=soft needs the base logits [B, T, V]")
    if token_map is not None and vocab_size is None:
        raise ValueError("a reduced head vocabulary (token_map) needs vocab_size")
    K = head_logits.shape[0]
    device = labels.device
    k, b, t = target_positions(labels, K)  # each [M]
    logits = head_logits[k, b, t]  # [M, V']
    if target == "labels":
        targets = labels[b, t + k + 2]  # [M] base ids
    else:
        targets = base_argmax[b, t + k + 1]
    head_targets = to_head_vocab(targets, token_map, vocab_size or 0)  # [M], -1 outside the head vocabulary

    if target == "soft":
        base_next = base_logits[b, t + k + 1]  # [M, V]: the base's distribution for position t + k + 2
        if token_map is not None:
            base_next = base_next[:, token_map.to(device)]
        base_logp = F.log_softmax(base_next.float(), dim=-1)
        head_logp = F.log_softmax(logits.float(), dim=-1)
        per_pos = (base_logp.exp() * (base_logp - head_logp)).sum(-1)  # KL(p_base || p_head), [M]
    else:
        per_pos = F.cross_entropy(logits.float(), head_targets.clamp_min(0), reduction="none")
        per_pos = per_pos * (head_targets >= 0)

    zeros = torch.zeros(K, dtype=torch.float32, device=device)
    loss_sum = zeros.index_add(0, k, per_pos.float())
    if normalizer is None:
        normalizer = (labels != IGNORE_INDEX).sum().clamp_min(1)
    loss = (decay_weights(K, decay, device) * loss_sum).sum() / normalizer

    with torch.no_grad():
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # [M, 5]
        hit1 = (top[:, 0] == head_targets).float()
        hit5 = (top == head_targets[:, None]).any(-1).float()
        correct1 = zeros.index_add(0, k, hit1)
        correct5 = zeros.index_add(0, k, hit5)
        count = zeros.index_add(0, k, torch.ones_like(hit1))
    return HeadLossOutput(loss=loss, loss_sum=loss_sum.detach(), correct_top1=correct1, correct_top5=correct5,
                          count=count)
