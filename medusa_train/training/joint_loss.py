"""Medusa-2 losses: the base model's loss (LM or self-distillation KL) and the ramp of the heads' weight.

Source: Cai et al. (2024, arXiv:2401.10774), Sec. 2.2.2, "Combined loss": ``L = L_LM + lambda_0 * sum_k lambda_k L_k``
with ``lambda_k = decay^k`` (:mod:`medusa_train.training.losses` computes the sum over heads) and lambda_0 warmed up
over training; Sec. 2.3.2: with self-distilled data the LM loss becomes ``KL(p_original || p_current)`` so the
fine-tuned model keeps the original's distribution. Here ``lambda_0(t) = medusa_loss_weight * s(t)``.

Positions: the base logits at t predict token t + 1, so position t counts when ``labels[t + 1] != -100`` (an
assistant token). Both losses return sums over those positions; the caller divides by the optimizer step's labelled
token count (the Trainer's ``num_items_in_batch``), as for the heads.

Two forms of each: on logits ``[B, T, V]`` already computed (:func:`base_loss_sum`), and on the last hidden states
with the lm_head's weight projecting ``chunk_size`` counted positions at a time (:func:`chunked_base_loss_sum`,
``trainer.loss_chunk_size``; the heads' chunked cross entropy, KL as its soft-target form): at Llama-3.1's 128k
vocabulary a 4,096-token sequence's logits are 2 GB in fp32, and the loss's softmax and gradient as much again each;
chunked, one ``[chunk_size, V]`` block lives at a time, recomputed in the backward pass. The two forms agree to
float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from medusa_train.config.schema import BASE_LOSSES, LOSS_RAMPS
from medusa_train.training.chunked_loss import chunked_linear_ce, linear_teacher
from medusa_train.training.losses import IGNORE_INDEX


def ramp(kind: str, step: int, ramp_steps: int) -> float:
    """s(t) in [0, 1] after ``step`` optimizer steps: ``constant`` 1; ``linear`` t / R; ``sine`` sin(pi/2 * t / R);
    1 once ``step >= ramp_steps`` (and always when ``ramp_steps == 0``).

    Raises:
        ValueError: ``kind`` not one of ``constant``, ``linear``, ``sine`` (field ``heads.loss_ramp``).
    """
    if kind not in LOSS_RAMPS:
        raise ValueError(f"heads.loss_ramp must be one of {LOSS_RAMPS}, got {kind!r}")
    if kind == "constant" or ramp_steps <= 0 or step >= ramp_steps:
        return 1.0
    x = step / ramp_steps
    return x if kind == "linear" else math.sin(0.5 * math.pi * x)


def next_token_positions(labels: torch.Tensor) -> torch.Tensor:
    """``labels [B, T]`` -> ``[B, T - 1]`` bool: the base logits at t count when ``labels[t + 1]`` is labelled."""
    return labels[:, 1:] != IGNORE_INDEX


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross entropy of the base on assistant tokens.

    Args:
        logits: ``[B, T, V]`` base logits (any float dtype; computed in float32).
        labels: ``[B, T]`` long, -100 off the assistant turns (not shifted).

    Returns:
        ``(loss sum, counted positions)``: float32 scalars.
    """
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (targets != IGNORE_INDEX).sum().float()


def kl_loss_sum(logits: torch.Tensor, reference_logits: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed ``KL(p_original || p_current)`` over the positions that predict an assistant token.

    Args:
        logits: ``[B, T, V]`` current base logits (gradient flows through them).
        reference_logits: ``[B, T, V]`` the original model's logits (no gradient).
        labels: ``[B, T]`` long (only its mask is used: the targets are the original's distributions).

    Returns:
        ``(loss sum, counted positions)``: float32 scalars; 0 when the two models agree.

    Raises:
        ValueError: the two logits' shapes differ.
    """
    if logits.shape != reference_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and reference_logits {tuple(reference_logits.shape)} differ")
    mask = next_token_positions(labels)  # [B, T-1]
    current = F.log_softmax(logits[:, :-1][mask].float(), dim=-1)  # [M, V]
    original = F.log_softmax(reference_logits[:, :-1][mask].float(), dim=-1)
    total = (original.exp() * (original - current)).sum()
    return total, mask.sum().float()


def base_loss_sum(kind: str, logits: torch.Tensor, labels: torch.Tensor,
                  reference_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``lm`` -> :func:`lm_loss_sum`; ``kl`` -> :func:`kl_loss_sum` (needs ``reference_logits``).

    Raises:
        ValueError: an unknown ``kind`` (field ``heads.base_loss``) or ``kl`` without reference logits.
    """
    check_base_loss(kind, reference_logits, "logits (reference_logits)")
    if kind == "lm":
        return lm_loss_sum(logits, labels)
    return kl_loss_sum(logits, reference_logits, labels)


def check_base_loss(kind: str, reference: torch.Tensor | None, what: str) -> None:
    """``kind`` is ``lm`` or ``kl`` (field ``heads.base_loss``), and ``kl`` has the original model's ``what``.

    Raises:
        ValueError: either not so.
    """
    if kind not in BASE_LOSSES:
        raise ValueError(f"heads.base_loss must be lm or kl, got {kind!r}")
    if kind == "kl" and reference is None:
        raise ValueError(f"heads.base_loss=kl needs the original model's {what}")


def chunked_base_loss_sum(kind: str, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
                          chunk_size: int, reference_hidden: torch.Tensor | None = None,
                          gather: Callable[[], AbstractContextManager] = nullcontext
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`base_loss_sum` from the last hidden states and the lm_head's weight, ``chunk_size`` counted positions
    projected at a time (:func:`~medusa_train.training.chunked_loss.chunked_linear_ce`).

    Args:
        kind: ``lm`` or ``kl`` (field ``heads.base_loss``).
        weight: ``[V, H]`` the base's lm_head weight (no bias), trainable or frozen.
        hidden: ``[B, T, H]`` the current base's last hidden states (after the final norm).
        labels: ``[B, T]`` long, -100 off the assistant turns (not shifted).
        chunk_size: counted positions projected at once (>= 1; ``trainer.loss_chunk_size``).
        reference_hidden: ``kl``: ``[B, T, H]`` the original model's last hidden states (no gradient); its logits
            come from the same weight (LoRA leaves the lm_head as it was).
        gather: a context in which ``weight`` holds its whole value (a frozen ZeRO-3 partitioned lm_head:
            :func:`~medusa_train.training.base_placement.gathered`), entered for the forward and again for the
            backward pass.

    Returns:
        ``(loss sum, counted positions)``: float32 scalars, equal to :func:`base_loss_sum` on the logits
        ``hidden @ weight^T`` up to float32 rounding.

    Raises:
        ValueError: an unknown ``kind``, ``kl`` without ``reference_hidden``, or ``chunk_size < 1``.
    """
    check_base_loss(kind, reference_hidden, "hidden states (reference_hidden)")
    mask = next_token_positions(labels)  # [B, T-1]
    rows = hidden[:, :-1][mask]  # [R, H]
    targets = labels[:, 1:][mask]
    teacher = None
    if kind == "kl":  # soft targets: the original model's distribution, read inside gather() (the weight whole)
        targets = torch.full_like(targets, -1)
        teacher = linear_teacher(reference_hidden[:, :-1][mask], weight)
    with gather():
        out = chunked_linear_ce(rows, weight, targets, chunk_size=chunk_size, teacher=teacher, gather=gather)
    return out.loss.float(), mask.sum().float()
