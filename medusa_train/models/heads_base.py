"""What every drafter type's heads share: the spec's common fields (:class:`HeadsSpec`, which each type's spec
derives), the reduced head vocabulary (a token map of V' base token ids) and the projection onto it.

Medusa heads (:mod:`medusa_train.drafters.medusa`) are the spec itself; Hydra heads and EAGLE-3 drafters derive it
and reuse the token map and the projection (:func:`register_token_map`, :func:`copy_lm_head`,
:func:`project_features`). Training reads the vocabulary helpers (:func:`build_token_map`, :func:`to_head_vocab`),
whatever the type.

Shapes: K heads, H hidden, V vocabulary (V' the heads').
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.models.catalog import type_of


@dataclass(frozen=True)
class HeadsSpec:
    """Shape of a set of Medusa heads.

    Attributes:
        num_heads: K (>= 1; ``heads.num_heads``).
        num_layers: residual blocks per head (>= 1; ``heads.num_layers``; FasterDecoding's default is 1).
        hidden_size: H of the base model.
        vocab_size: V of the base model.
        share_lm_head: project with the base model's lm_head (vLLM's ``original_lm_head``) instead of a copy per head.
        head_vocab_size: V' <= V when the heads use a reduced vocabulary (``truncated_vocab_size``); None for all V.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    share_lm_head: bool = False
    head_vocab_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.head_vocab_size is not None and not 1 <= self.head_vocab_size <= self.vocab_size:
            raise ValueError(
                f"head_vocab_size (truncated_vocab_size) must be in [1, vocab_size={self.vocab_size}], "
                f"got {self.head_vocab_size}"
            )

    @property
    def out_size(self) -> int:
        """V', the number of logits each head produces."""
        return self.head_vocab_size or self.vocab_size

    @property
    def head_type(self) -> str:
        """The registered drafter type of this spec's class (:mod:`medusa_train.models.catalog`): ``"medusa"``
        here, ``"hydra"`` for :class:`~medusa_train.drafters.hydra.heads.HydraSpec`."""
        return type_of(self).name


def register_token_map(module: nn.Module, spec: HeadsSpec, token_map: torch.Tensor | None) -> None:
    """Give ``module`` its ``token_map`` buffer ``[V']`` long (a reduced head vocabulary), or ``token_map = None``.

    Raises:
        ValueError: ``spec.head_vocab_size`` is set and ``token_map`` is missing or not ``[head_vocab_size]``.
    """
    if spec.head_vocab_size is None:
        module.token_map = None
        return
    if token_map is None or token_map.shape != (spec.head_vocab_size,):
        raise ValueError(
            f"token_map must be a [{spec.head_vocab_size}] long tensor when head_vocab_size is set, "
            f"got {None if token_map is None else tuple(token_map.shape)}"
        )
    module.register_buffer("token_map", token_map.to(torch.long).clone())


@torch.no_grad()
def copy_lm_head(
    lm_head_weight: torch.Tensor | None, token_map: torch.Tensor | None, base_lm_head_weight: torch.Tensor
) -> None:
    """Fill every head's projection ``[K, V', H]`` with the base lm_head ``[V, H]`` (its ``token_map`` rows); a no-op
    for heads that project with the base lm_head itself (``lm_head_weight`` None)."""
    if lm_head_weight is None:
        return
    weight = base_lm_head_weight if token_map is None else base_lm_head_weight[token_map]
    lm_head_weight.copy_(weight.to(lm_head_weight.dtype).unsqueeze(0).expand_as(lm_head_weight))


def to_head_vocab(token_ids: torch.Tensor, token_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Base token ids (any shape, long) -> head-vocabulary indices, the inverse of ``token_map`` (``[V']`` long, the
    base id of each head-vocabulary index); -1 for tokens outside a reduced head vocabulary. ``token_ids`` is
    returned as is without a map (V' = V)."""
    if token_map is None:
        return token_ids
    inverse = torch.full((vocab_size,), -1, dtype=torch.long, device=token_ids.device)
    inverse[token_map.to(token_ids.device)] = torch.arange(token_map.numel(), device=token_ids.device)
    return inverse[token_ids]


def project_features(
    features: torch.Tensor,
    lm_head_weight: torch.Tensor | None,
    token_map: torch.Tensor | None,
    base_lm_head_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Project the features of K heads to logits over the head vocabulary, all heads in one batched product.

    Args:
        features: ``[K, ..., H]``; cast to the projection's dtype.
        lm_head_weight: ``[K, V', H]`` per-head projections, or None to project with the base lm_head.
        token_map: ``[V']`` long rows of the base lm_head to use when projecting with it (None: all V).
        base_lm_head_weight: ``[V, H]``, required when ``lm_head_weight`` is None.

    Returns:
        ``[K, ..., V']`` logits.

    Raises:
        ValueError: no projection given (``share_lm_head`` without the base lm_head weight).
    """
    K, H = features.shape[0], features.shape[-1]
    lead = features.shape[1:-1]
    flat = features.reshape(K, -1, H)
    weight = projection_weight(lm_head_weight, token_map, base_lm_head_weight)
    if weight.dim() == 3:
        logits = torch.bmm(flat.to(weight.dtype), weight.transpose(1, 2))  # [K, M, V']
    else:
        logits = (flat.reshape(-1, H).to(weight.dtype) @ weight.T).reshape(K, flat.shape[1], -1)
    return logits.reshape(K, *lead, logits.shape[-1])


def projection_weight(lm_head_weight: torch.Tensor | None, token_map: torch.Tensor | None,
                      base_lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The heads' projection onto the head vocabulary: ``lm_head_weight [K, V', H]`` (one per head) when given, else
    the base lm_head ``[V, H]`` (its ``token_map [V']`` rows: ``[V', H]``), shared by all heads.

    Raises:
        ValueError: neither given (``share_lm_head`` without the base lm_head weight).
    """
    if lm_head_weight is not None:
        return lm_head_weight
    if base_lm_head_weight is None:
        raise ValueError("share_lm_head=True: pass the base model's lm_head weight [V, H] to project()")
    return base_lm_head_weight if token_map is None else base_lm_head_weight[token_map.to(base_lm_head_weight.device)]


def build_token_map(token_counts: torch.Tensor, head_vocab_size: int) -> torch.Tensor:
    """The ``head_vocab_size`` most frequent token ids, sorted by id, as a reduced head vocabulary.

    Args:
        token_counts: ``[V]`` counts of each token among the training labels.
        head_vocab_size: V' tokens to keep.

    Returns:
        ``[V']`` long tensor of base token ids (vLLM's ``token_map``).
    """
    if not 1 <= head_vocab_size <= token_counts.numel():
        raise ValueError(f"head_vocab_size must be in [1, {token_counts.numel()}], got {head_vocab_size}")
    top = torch.topk(token_counts.to(torch.float64), head_vocab_size, sorted=False).indices
    return torch.sort(top).values.to(torch.long)


__all__ = ["HeadsSpec", "build_token_map", "copy_lm_head", "project_features", "projection_weight",
           "register_token_map", "to_head_vocab"]
