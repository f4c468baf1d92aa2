"""Per-head top-1/top-5 accuracy of trained heads on the held-out split (the end-of-training table)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from medusa_train.training.metrics import HeadMetrics
from medusa_train.training.step import FrozenBase, LossSpec, heads_on_batch


@torch.no_grad()
def head_accuracy(
    heads: nn.Module,
    base: FrozenBase,
    dataset: Sequence[Any],
    collator: Callable[[list[Any]], dict[str, torch.Tensor]],
    spec: LossSpec,
    batch_size: int,
    device: torch.device | str,
) -> dict[str, Any]:
    """Accuracy table of ``heads`` over every row of ``dataset``, in order, in this process alone.

    Args:
        heads: ``MedusaHeads`` (unwrapped, full parameters) on ``device``.
        base: the frozen base (with its backbone, unless ``dataset`` yields cached ``hidden`` rows).
        dataset: token rows (``input_ids``, ``labels``) or cached rows (``hidden``, ``base_argmax``, ``labels``).
        collator: pads a list of rows into a batch.
        spec: target and head-vocabulary settings; accuracy is against the training target (data tokens for
            ``labels``, the base model's greedy tokens for ``base_argmax`` and ``soft``).
        batch_size: rows per batch.
        device: where the batches go.

    Returns:
        ``{"top1": [K], "top5": [K], "loss": [K], "positions": [K]}`` (empty dataset: zeros).
    """
    was_training = heads.training
    heads.eval()
    metrics = HeadMetrics(heads.spec.num_heads)
    for start in range(0, len(dataset), batch_size):
        batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        out = heads_on_batch(heads, base, batch, spec)
        metrics.add(out)
    heads.train(was_training)
    return metrics.table()
