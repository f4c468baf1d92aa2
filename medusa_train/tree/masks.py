"""Masks and positions of batch rows whose KV caches hold holes, shared by the decoders and the drafters that keep a
cache of their own (EAGLE-3's).

A batch row's KV cache may hold slots that are not part of its sequence: left padding before a short prompt, and,
in tree decoding, the slots a row leaves empty when another row accepted a longer path in the same step. A bool
``past_valid [B, L]`` marks the real slots; masks hide the others and positions count real tokens only, so each
row computes exactly what it would alone.

Shapes: B batch, T prompt length (left-padded), L cache slots, Q new tokens, N keys written after the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor


def positions(valid: Tensor) -> Tensor:
    """Position ids of a left-padded prompt batch: long ``[B, T]``, 0 at each row's first real token."""
    return (valid.long().cumsum(dim=-1) - 1).clamp(min=0)


def additive_mask(past_valid: Tensor, new_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The 4-D additive attention mask of Q new tokens on top of a cache of L slots.

    Args:
        past_valid: bool ``[B, L]``, True at the cache slots each row may attend.
        new_mask: bool ``[Q, N]`` or ``[B, Q, N]``, which of the N keys written after the cache each new token may
            attend (N = Q: causal for a prompt, ancestor-or-self for a tree; N > Q when earlier entries of the same
            step precede the Q new ones, as a drafter's deeper tree levels).
        dtype: the attention dtype.

    Returns:
        ``[B, 1, Q, L + N]``: 0 where attention is allowed, ``finfo(dtype).min`` elsewhere.
    """
    b, q = past_valid.shape[0], new_mask.shape[-2]
    allowed = torch.cat([past_valid[:, None, :].expand(b, q, -1), new_mask.expand(b, q, -1)], dim=-1)
    zero = torch.zeros((), dtype=dtype, device=past_valid.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min).unsqueeze(1)


__all__ = ["additive_mask", "positions"]
