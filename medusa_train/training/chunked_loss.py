"""Cross entropy of a linear projection onto the vocabulary, ``chunk_size`` rows at a time.

The heads' loss projects R rows (one head at one counted position each) onto V' logits. Held at once, at a 128k
vocabulary, 2,048 positions and 5 heads, those logits are 5 GB in fp32, and their gradient as much again.
:class:`ChunkedLinearCE` never holds more than one ``[chunk, V']`` block of logits (and the few temporaries of its
softmax): the forward pass computes each chunk's logits, its loss and top-1/top-5 hits and drops the logits; the
backward pass recomputes them chunk by chunk and forms the gradient with respect to the features and the weight
(when it requires grad) straight from ``softmax - target``.

Source: the chunked "fused linear cross entropy" of Liger-Kernel (``src/liger_kernel/ops/fused_linear_cross_entropy.py``,
which computes the gradient in its forward pass) and Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary
Language Models" (arXiv:2411.09009, Sec. 4: recompute the logits in the backward pass instead of storing them). Ours
is plain PyTorch, rows in chunks, and also takes soft targets (the base's distribution, itself computed chunk by
chunk) and per-head projection weights.

Products run in the weight's dtype (under autocast, in its dtype, in both passes), the softmax and the loss in
float32; the weight's gradient is summed over chunks in the weight's dtype.

Per row i with logits ``z_i = x_i W_{g(i)}^T`` (float32), ``p_i = softmax(z_i)``:

- hard target ``y_i`` (a head-vocabulary index; < 0: none, the row's loss and gradient are 0):
  ``l_i = logsumexp(z_i) - z_{i, y_i}``, ``dl_i/dz_i = p_i - onehot(y_i)``;
- soft target ``q_i = softmax(teacher_i)``: ``l_i = KL(q_i || p_i) = sum_v q_iv (log q_iv - z_iv) + logsumexp(z_i)``,
  ``dl_i/dz_i = p_i - q_i``.

The loss is ``sum_i w_i l_i`` with constant row weights ``w_i`` (Medusa's ``decay ** k``).

Shapes: R rows, H hidden, V' vocabulary of the projection, G weight groups (heads with their own projection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (start, end) -> [end - start, V'] float32 teacher logits of rows start .. end - 1 (no gradient)
TeacherFn = Callable[[int, int], torch.Tensor]


@dataclass
class ChunkedCEOutput:
    """One :func:`chunked_linear_ce`.

    Attributes:
        loss: scalar float32 (float64 for a float64 weight), ``sum_i w_i l_i`` (differentiable with respect to the
            features and the weight).
        row_loss: ``[R]`` ``l_i`` in the loss's dtype, detached (0 for rows without a hard target).
        top1, top5: ``[R]`` bool, the row's hard target is its top-1 / among its top-min(5, V') logits (False for rows
            without one).
    """

    loss: torch.Tensor
    row_loss: torch.Tensor
    top1: torch.Tensor
    top5: torch.Tensor


def linear_teacher(features: torch.Tensor, weight: torch.Tensor) -> TeacherFn:
    """A :data:`TeacherFn` over rows of ``features [R, H]``: ``features[s:e] @ weight [V', H]^T`` in the weight's dtype,
    returned as float32 (the base's logits from its hidden states and lm_head rows, no gradient). The weight is read
    at each call, not when the teacher is made: a ZeRO-3 partitioned one holds its value only inside its gather."""
    features = features.detach()

    def rows(start: int, end: int) -> torch.Tensor:
        w = weight.detach()
        return (features[start:end].to(w.dtype) @ w.T).float()

    return rows


def rows_teacher(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 token_map: torch.Tensor | None = None) -> TeacherFn:
    """A :data:`TeacherFn` reading ``logits [B, T, V]`` (already computed, e.g. Medusa-2's base logits) at positions
    ``(rows[i], cols[i])`` (``[R]`` long each), over the vocabulary ``token_map [V']`` (None: all V), gathered one
    chunk at a time (never ``[R, V']`` at once)."""
    logits = logits.detach()
    token_map = None if token_map is None else token_map.to(logits.device)

    def chunk(start: int, end: int) -> torch.Tensor:
        block = logits[rows[start:end], cols[start:end]]
        return (block if token_map is None else block[:, token_map]).float()

    return chunk


@torch.no_grad()
def chunked_argmax(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                   chunk_size: int) -> torch.Tensor:
    """The greedy tokens of ``project`` (an lm_head: ``[N, H] -> [N, V]``) at every position of ``hidden [..., H]``:
    ``[...]`` long, ``chunk_size`` positions projected at a time (0: all at once, the ``[..., V]`` logits held)."""
    if not chunk_size:
        return project(hidden).argmax(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = [project(flat[s : s + chunk_size]).argmax(-1) for s in range(0, flat.shape[0], chunk_size)]
    return torch.cat(out).reshape(hidden.shape[:-1]) if out else flat.new_zeros(hidden.shape[:-1], dtype=torch.long)


def _spans(group_sizes: Sequence[int], chunk_size: int) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` row spans of at most ``chunk_size`` rows, none crossing a group boundary."""
    spans, start = [], 0
    for g, size in enumerate(group_sizes):
        for s in range(start, start + size, chunk_size):
            spans.append((g, s, min(s + chunk_size, start + size)))
        start += size
    return spans


def _accumulate_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 for a float64 weight: the dtype of the logits, the loss and the softmax."""
    return torch.promote_types(weight.dtype, torch.float32)


def _chunk_logits(features: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return (features[start:end].to(weight.dtype) @ weight.T).to(_accumulate_dtype(weight))  # [c, V']


class ChunkedLinearCE(torch.autograd.Function):
    """``(features [R, H], weight [V', H] or [G, V', H], targets [R], row_weight [R], group_sizes, chunk_size,
    teacher) -> (loss, row_loss, top1, top5)``; see :func:`chunked_linear_ce` (its public entry point)."""

    @staticmethod
    def forward(ctx, features, weight, targets, row_weight, group_sizes, chunk_size, teacher, gather):
        weights = weight if weight.dim() == 3 else weight[None]
        R = features.shape[0]
        row_loss = torch.zeros(R, dtype=_accumulate_dtype(weight), device=features.device)
        top1 = torch.zeros(R, dtype=torch.bool, device=features.device)
        top5 = torch.zeros(R, dtype=torch.bool, device=features.device)
        spans = _spans(group_sizes, chunk_size)
        with torch.no_grad():
            for g, s, e in spans:
                z = _chunk_logits(features, weights[g], s, e)  # [c, V'], the only block of this size kept
                y = targets[s:e]
                has = y >= 0
                lse = torch.logsumexp(z, dim=-1)
                top = z.topk(min(5, z.shape[-1]), dim=-1).indices
                top1[s:e] = top[:, 0] == y
                top5[s:e] = (top == y[:, None]).any(-1)
                if teacher is None:
                    picked = z.gather(1, y.clamp_min(0)[:, None])[:, 0]
                    row_loss[s:e] = torch.where(has, lse - picked, 0.0)
                else:
                    del top
                    logq = F.log_softmax(teacher(s, e).to(z.dtype), dim=-1)
                    z.neg_().add_(logq)  # log q - z, in place
                    row_loss[s:e] = (logq.exp_() * z).sum(-1) + lse
                del z
        loss = (row_weight * row_loss).sum()
        ctx.save_for_backward(features, weight, targets, row_weight)
        ctx.spans, ctx.teacher, ctx.gather = spans, teacher, gather
        device = features.device.type
        # the backward pass recomputes the logits as this pass did: under the same autocast (mixed precision)
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        ctx.mark_non_differentiable(row_loss, top1, top5)
        return loss, row_loss, top1, top5

    @staticmethod
    def backward(ctx, grad_loss, *_):
        features, weight, targets, row_weight = ctx.saved_tensors
        with ctx.gather():  # the weight whole again (a ZeRO-3 partitioned one is gathered)
            grad_x, grad_w = ChunkedLinearCE._gradients(ctx, grad_loss, features, weight, targets, row_weight)
        return grad_x, grad_w, None, None, None, None, None, None

    @staticmethod
    def _gradients(ctx, grad_loss, features, weight, targets, row_weight):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        weights = weight if weight.dim() == 3 else weight[None]
        grad_x = torch.zeros_like(features) if need_x else None
        grad_w = torch.zeros_like(weights) if need_w else None
        if need_x or need_w:
            scale = grad_loss.to(_accumulate_dtype(weight)) * row_weight  # [R]
            autocast = (torch.autocast(*ctx.autocast) if ctx.autocast is not None
                        else torch.autocast(features.device.type, enabled=False))
            with torch.no_grad(), autocast:
                for g, s, e in ctx.spans:
                    w = weights[g]
                    z = _chunk_logits(features, w, s, e)
                    p = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True)).exp_()  # softmax, in place
                    y = targets[s:e]
                    if ctx.teacher is None:
                        has = y >= 0
                        rows = torch.arange(e - s, device=p.device)[has]
                        p[rows, y[has]] -= 1.0
                        p.mul_((scale[s:e] * has)[:, None])
                    else:
                        p.sub_(F.softmax(ctx.teacher(s, e).to(p.dtype), dim=-1)).mul_(scale[s:e, None])
                    dz = p.to(w.dtype)  # [c, V']
                    if need_x:
                        grad_x[s:e] = (dz @ w).to(features.dtype)
                    if need_w:
                        grad_w[g].addmm_(dz.T.to(grad_w.dtype), features[s:e].to(grad_w.dtype))
                    del z, p, dz
        if grad_w is not None and weight.dim() == 2:
            grad_w = grad_w[0]
        return grad_x, grad_w


def chunked_linear_ce(
    features: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    row_weight: torch.Tensor | None = None,
    group_sizes: Sequence[int] | None = None,
    teacher: TeacherFn | None = None,
    gather: Callable[[], AbstractContextManager] = nullcontext,
) -> ChunkedCEOutput:
    """The summed cross entropy (or KL to a teacher) of ``features @ weight^T``, ``chunk_size`` rows at a time.

    Args:
        features: ``[R, H]`` float, with gradient or not; cast to the weight's dtype for the products.
        weight: ``[V', H]`` one projection for all rows, or ``[G, V', H]`` one per group of rows; trainable or frozen
            (its gradient is formed only when it requires grad).
        targets: ``[R]`` long hard targets (head-vocabulary indices; < 0: no hard target, loss 0 and a miss). With a
            ``teacher`` they only feed the top-1/top-5 hits.
        chunk_size: rows projected at once (>= 1; ``trainer.loss_chunk_size``).
        row_weight: ``[R]`` float32 constant weight of each row's loss (None: 1).
        group_sizes: with a ``[G, V', H]`` weight, the number of consecutive rows of each group (sum R); None: all
            rows in one group.
        teacher: soft targets: :data:`TeacherFn` giving the teacher's logits of rows ``start .. end - 1`` over the
            same V' (:func:`linear_teacher`, :func:`rows_teacher`), called once per chunk in the forward pass and
            again in the backward pass; the loss is then ``KL(softmax(teacher) || softmax(logits))``.
        gather: a context in which ``weight`` holds its whole value, entered again by the backward pass (a frozen
            ZeRO-3 partitioned weight: :func:`~medusa_train.training.base_placement.gathered`; the caller runs this
            call inside it too); the default: none needed.

    Returns:
        :class:`ChunkedCEOutput`; equal, up to float32 rounding, to the same loss on the logits computed at once.

    Raises:
        ValueError: mis-shaped inputs, ``chunk_size < 1``, or group sizes that do not match the weight or R.
    """
    if features.dim() != 2 or targets.shape != features.shape[:1]:
        raise ValueError(f"features must be [R, H] and targets [R], got {tuple(features.shape)} and "
                         f"{tuple(targets.shape)}")
    if weight.dim() not in (2, 3) or weight.shape[-1] != features.shape[-1]:
        raise ValueError(f"weight must be [V', H] or [G, V', H] with H = {features.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size (trainer.loss_chunk_size) must be an integer >= 1, got {chunk_size!r}")
    R = features.shape[0]
    groups = weight.shape[0] if weight.dim() == 3 else 1
    sizes = [int(n) for n in (group_sizes if group_sizes is not None else [R])]
    if len(sizes) != groups or sum(sizes) != R or min(sizes, default=0) < 0:
        raise ValueError(f"group_sizes {sizes} must give {groups} non-negative row counts summing to R = {R}")
    if row_weight is None:
        row_weight = torch.ones(R, dtype=torch.float32, device=features.device)
    loss, row_loss, top1, top5 = ChunkedLinearCE.apply(features, weight, targets,
                                                       row_weight.to(_accumulate_dtype(weight)), sizes, chunk_size,
                                                       teacher, gather)
    return ChunkedCEOutput(loss=loss, row_loss=row_loss, top1=top1, top5=top5)


__all__ = ["ChunkedCEOutput", "ChunkedLinearCE", "TeacherFn", "chunked_argmax", "chunked_linear_ce",
           "linear_teacher", "rows_teacher"]
