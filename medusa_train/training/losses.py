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

from typing import NamedTuple

import torch
import torch.nn.functional as F

from medusa_train.models.heads_base import to_head_vocab
from medusa_train.training.chunked_loss import TeacherFn, chunked_linear_ce

IGNORE_INDEX = -100
TARGETS = ("labels", "base_argmax", "soft")


class HeadLossOutput(NamedTuple):
    """One batch's loss and the sums behind the per-head metrics.

    A named tuple, so that wrappers that hook a module's output tensors find them when the heads' forward returns
    it (DeepSpeed ZeRO-3 gathers the weights again before the backward pass through those hooks).

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


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The default loss normaliser: assistant (labelled, ``!= -100``) tokens in ``labels``, at least 1."""
    return (labels != IGNORE_INDEX).sum().clamp_min(1)


def head_targets(
    labels: torch.Tensor, num_heads: int, *, target: str, base_argmax: torch.Tensor | None = None
) -> torch.Tensor:
    """The base token id each head must predict at each position.

    Args:
        labels: ``[B, T]`` long, token ids on assistant turns and -100 elsewhere (not shifted).
        num_heads: K.
        target: ``labels`` (the data token at ``t + k + 2``) or ``base_argmax``/``soft`` (the base's greedy token for
            ``t + k + 2``, ``base_argmax[t + k + 1]``).
        base_argmax: ``[B, T]`` long, needed unless ``target == "labels"``.

    Returns:
        ``[K, B, T]`` long base ids, -100 where head k at t is not counted (see :func:`valid_mask`).
    """
    source, shift = (labels, 2) if target == "labels" else (base_argmax, 1)
    T = labels.shape[1]
    targets = torch.full((num_heads, *labels.shape), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    for k in range(num_heads):
        if k + 2 < T:
            targets[k, :, : T - k - 2] = source[:, k + shift : T - 2 + shift]
    return targets.masked_fill_(~valid_mask(labels, num_heads), IGNORE_INDEX)


def heads_loss(
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
    K = head_logits.shape[0]
    targets = head_targets(labels, K, target=target, base_argmax=base_argmax)  # [K, B, T]
    k, b, t = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # each [M]
    base_next = None
    if target == "soft":
        base_next = base_logits[b, t + k + 1]  # [M, V]: the base's distribution for position t + k + 2
        if token_map is not None:
            base_next = base_next[:, token_map.to(base_next.device)]  # [M, V']
    if normalizer is None:
        normalizer = labelled_tokens(labels)
    return _loss_on_rows(head_logits[k, b, t], targets[k, b, t], k, K, decay=decay, token_map=token_map,
                         vocab_size=vocab_size, normalizer=normalizer, base_next=base_next)


def packed_head_loss(
    head_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    decay: float,
    normalizer: torch.Tensor | float,
    token_map: torch.Tensor | None = None,
    vocab_size: int | None = None,
    base_next: torch.Tensor | None = None,
) -> HeadLossOutput:
    """:func:`heads_loss` for logits computed only at the positions some head counts.

    A batch of chat rows is mostly padding and prompt tokens that no head is trained on; projecting only the
    counted positions onto the head vocabulary (the bulk of the heads' compute) gives the same loss, gradient and
    metrics as the dense path for a fraction of the work.

    Args:
        head_logits: ``[K, M, V']`` head logits at M gathered positions.
        targets: ``[K, M]`` long base ids from :func:`head_targets` at the same positions (-100: not counted).
        decay: head k's loss weight is ``decay ** k``.
        normalizer: the labelled tokens to divide by (of the batch, or of the optimizer step across ranks).
        token_map, vocab_size: as :func:`heads_loss`.
        base_next: ``soft`` targets: ``[R, V']`` base logits (restricted to the head vocabulary) for the R counted
            rows, in the order of ``(targets != -100).nonzero()`` (head-major): row (k, m) holds the base's logits
            at position ``t_m + k + 1``, its distribution for the token at ``t_m + k + 2``. None: hard targets.

    Returns:
        :class:`HeadLossOutput`, equal to the dense path's on the same batch.

    Raises:
        ValueError: shapes that do not match, or a token map without ``vocab_size``.
    """
    if head_logits.ndim != 3 or head_logits.shape[:2] != targets.shape:
        raise ValueError(f"head_logits must be [K, M, V'] with [K, M] = targets.shape {tuple(targets.shape)}, "
                         f"got {tuple(head_logits.shape)}")
    k, m = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    if base_next is not None and base_next.shape != (k.numel(), head_logits.shape[-1]):
        raise ValueError(f"base_next must be [R, V'] = {(k.numel(), head_logits.shape[-1])} (one row per counted "
                         f"head and position), got {tuple(base_next.shape)}")
    return _loss_on_rows(head_logits[k, m], targets[k, m], k, head_logits.shape[0], decay=decay,
                         token_map=token_map, vocab_size=vocab_size, normalizer=normalizer, base_next=base_next)


def _loss_on_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: torch.Tensor,
    num_heads: int,
    *,
    decay: float,
    token_map: torch.Tensor | None,
    vocab_size: int | None,
    normalizer: torch.Tensor | float,
    base_next: torch.Tensor | None = None,
) -> HeadLossOutput:
    """The loss and metric sums over counted rows: ``logits [M, V']``, base-id ``targets [M]``, head index ``k [M]``;
    ``base_next [M, V']`` base logits over the head vocabulary makes the loss the KL to the base distribution
    (``soft``; with a reduced head vocabulary, renormalised over it)."""
    if token_map is not None and vocab_size is None:
        raise ValueError("a reduced head vocabulary (token_map) needs vocab_size")
    device = logits.device
    K = num_heads
    head_targets_ = to_head_vocab(targets, token_map, vocab_size or 0)  # [M], -1 outside the head vocabulary
    if base_next is not None:
        base_logp = F.log_softmax(base_next.float(), dim=-1)
        head_logp = F.log_softmax(logits.float(), dim=-1)
        per_pos = (base_logp.exp() * (base_logp - head_logp)).sum(-1)  # KL(p_base || p_head), [M]
    else:
        per_pos = F.cross_entropy(logits.float(), head_targets_.clamp_min(0), reduction="none")
        per_pos = per_pos * (head_targets_ >= 0)

    zeros = torch.zeros(K, dtype=torch.float32, device=device)
    loss_sum = zeros.index_add(0, k, per_pos.float())
    loss = (decay_weights(K, decay, device) * loss_sum).sum() / normalizer

    with torch.no_grad():
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # [M, 5]
        hit1 = top[:, 0] == head_targets_
        hit5 = (top == head_targets_[:, None]).any(-1)
    return _head_output(loss, loss_sum.detach(), hit1, hit5, k, K)


def _head_output(loss: torch.Tensor, loss_sum: torch.Tensor, hit1: torch.Tensor, hit5: torch.Tensor,
                 k: torch.Tensor, num_heads: int) -> HeadLossOutput:
    """:class:`HeadLossOutput` from the loss, ``loss_sum [K]`` and the rows' hits ``[M]`` bool of heads ``k [M]``."""
    zeros = torch.zeros(num_heads, dtype=torch.float32, device=k.device)
    hit1, hit5 = hit1.float(), hit5.float()
    return HeadLossOutput(loss=loss, loss_sum=loss_sum, correct_top1=zeros.index_add(0, k, hit1),
                          correct_top5=zeros.index_add(0, k, hit5), count=zeros.index_add(0, k, torch.ones_like(hit1)))


def projected_head_loss(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    decay: float,
    normalizer: torch.Tensor | float,
    chunk_size: int,
    token_map: torch.Tensor | None = None,
    vocab_size: int | None = None,
    teacher: TeacherFn | None = None,
) -> HeadLossOutput:
    """:func:`packed_head_loss` on the heads' features and projection, ``chunk_size`` rows at a time
    (:func:`~medusa_train.training.chunked_loss.chunked_linear_ce`): never more than ``[chunk_size, V']`` logits at
    once, where :func:`packed_head_loss` holds ``[K, M, V']`` and their gradient.

    Args:
        features: ``[K, M, H]`` head features at M gathered positions (head k's logits are ``features[k] @
            weight^T``).
        weight: ``[V', H]`` shared by the heads, or ``[K, V', H]`` one per head.
        targets: ``[K, M]`` long base ids from :func:`head_targets` (-100: not counted).
        decay, normalizer, token_map, vocab_size: as :func:`packed_head_loss`.
        chunk_size: rows (one head at one position) projected at once (``trainer.loss_chunk_size``, >= 1).
        teacher: ``soft`` targets: the base's logits over the head vocabulary for the counted rows in the order of
            ``(targets != -100).nonzero()`` (head-major), a :data:`~medusa_train.training.chunked_loss.TeacherFn`
            read one chunk at a time. None: hard targets.

    Returns:
        :class:`HeadLossOutput`, equal to :func:`packed_head_loss`'s on the logits ``features @ weight^T`` (up to
        float32 rounding: the same terms summed in another order).

    Raises:
        ValueError: mis-shaped inputs, a token map without ``vocab_size``, or ``chunk_size < 1``.
    """
    K = features.shape[0]
    if features.dim() != 3 or features.shape[:2] != targets.shape:
        raise ValueError(f"features must be [K, M, H] with [K, M] = targets.shape {tuple(targets.shape)}, got "
                         f"{tuple(features.shape)}")
    if weight.dim() == 3 and weight.shape[0] != K:
        raise ValueError(f"a per-head weight must be [K={K}, V', H], got {tuple(weight.shape)}")
    if token_map is not None and vocab_size is None:
        raise ValueError("a reduced head vocabulary (token_map) needs vocab_size")
    k, m = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # head-major: head k's rows are consecutive
    rows = to_head_vocab(targets[k, m], token_map, vocab_size or 0)  # [R], -1 outside the head vocabulary
    out = chunked_linear_ce(features[k, m], weight, rows, chunk_size=chunk_size,
                            row_weight=decay_weights(K, decay, features.device)[k],
                            group_sizes=torch.bincount(k, minlength=K).tolist() if weight.dim() == 3 else None,
                            teacher=teacher)
    loss_sum = torch.zeros(K, dtype=torch.float32, device=features.device).index_add(0, k, out.row_loss.float())
    return _head_output(out.loss / normalizer, loss_sum, out.top1, out.top5, k, K)
