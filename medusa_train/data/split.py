"""Deterministic held-out split of conversations."""

from __future__ import annotations

import random


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(n)`` into train and eval indices, the same for the same ``(n, eval_fraction, seed)``.

    The eval side holds ``round(n * eval_fraction)`` indices, at least 1 when ``eval_fraction > 0`` and at most
    ``n - 1`` (so training keeps one), drawn with ``random.Random(seed)``. Both lists are sorted.

    Raises:
        ValueError: ``n`` is negative or ``eval_fraction`` is outside [0, 1).
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n_eval = round(n * eval_fraction)
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    else:
        n_eval = min(n_eval, max(n - 1, 0))
    held_out = set(random.Random(seed).sample(range(n), n_eval))
    train = [i for i in range(n) if i not in held_out]
    return train, sorted(held_out)
