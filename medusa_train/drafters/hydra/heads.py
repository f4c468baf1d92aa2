"""Hydra heads: draft heads that read the candidate path's tokens as well as the base model's hidden state.

Source: Ankner et al., "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding" (2024, arXiv:2402.05109),
Sec. 3: Medusa's heads are *sequentially independent*, head i guessing the token i steps ahead from the hidden state
alone; a Hydra head also reads the tokens of the candidate continuation before its own position,
``f_i(h_{t-1}, x_t, ..., x_{t+i-1})``. Here, with our 0-based heads: head k reads the base model's last hidden state
at t and the base model's own (frozen) input embeddings of the path tokens t+1 .. t+k+1 (the root, which is the base
model's next token, and the drafted tokens above the node), and predicts the token at t + k + 2, the position Medusa
head k predicts. Decoding must therefore run the heads level by level down the tree
(:mod:`medusa_train.drafters.hydra.proposer`); training feeds the true tokens (teacher forcing,
:func:`medusa_train.models.catalog.shifted_path_tokens`).

Each head is an MLP of ``num_layers`` residual blocks (``heads.num_layers``) over the combined inputs, then a
vocabulary projection exactly as Medusa's (per head, the base lm_head shared, or a reduced head vocabulary with its
token map: :class:`~medusa_train.models.heads_base.HeadsSpec`). ``combine`` says how the inputs meet:

- ``concat`` (the paper's, Sec. 3): ``x_0 = [h_t; e_{t+1}; ...; e_{t+k+1}]`` of width ``(k + 2) H``; the first block
  is ``x_1 = R x_0 + SiLU(W x_0 + b)`` with a learnt ``R [H, (k+2)H]`` for the residual path (the authors'
  ``ResBlock`` with conditioning inputs, zankner/Hydra ``hydra/model/hydra_heads/prefix_mlp_head.py`` at 7f39cbd),
  then ``x_{l+1} = x_l + SiLU(W_l x_l + b_l)``. Head k's first block costs ``(k + 2)`` times a Medusa block.
- ``sum``: ``x_0 = h_t + sum_j e_{t+j}``, then Medusa's residual blocks: Medusa's cost, order of the path lost.

Initialisation as Medusa's (Sec. 2.1.1 of the Medusa paper): zero blocks, ``R = [I, 0, ..., 0]`` and projections
copied from the base lm_head, so a fresh ``concat`` head computes ``lm_head(h_t)`` (the base's own next-token guess)
and learns from there.

Shapes: B batch, T sequence, K heads, M positions, H hidden, V vocabulary (V' the heads').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from medusa_train.models.catalog import ProjectFn, TargetInputs
from medusa_train.models.features import FINAL
from medusa_train.models.heads_base import HeadsSpec, copy_lm_head, project_features, projection_weight, register_token_map

COMBINES = ("concat", "sum")


@dataclass(frozen=True)
class HydraSpec(HeadsSpec):
    """Shape of a set of Hydra heads: :class:`~medusa_train.models.heads_base.HeadsSpec` (``num_layers`` residual blocks per
    head, the projection settings) plus how each head combines its inputs.

    Attributes:
        combine: ``concat`` or ``sum`` (see the module docstring).
    """

    combine: str = "concat"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.combine not in COMBINES:
            raise ValueError(f"Hydra heads' combine (heads.combine) must be one of {COMBINES}, got {self.combine!r}")

    def in_features(self, k: int) -> int:
        """Width of head k's combined input: ``(k + 2) H`` for ``concat``, ``H`` for ``sum``."""
        return (k + 2) * self.hidden_size if self.combine == "concat" else self.hidden_size


class HydraHead(nn.Module):
    """One head's MLP: ``[..., in_features]`` -> ``[..., H]`` through ``num_layers`` residual blocks.

    Parameters:
        residual: ``Linear(in_features, H, bias=False)`` on the first block's skip path, present only when
            ``in_features != H``; initialised to ``[I, 0, ..., 0]`` (it passes the hidden state through).
        layers: ``num_layers`` ``Linear`` layers (the first ``in_features -> H``, the others ``H -> H``), zero.
    """

    def __init__(self, in_features: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.residual = nn.Linear(in_features, hidden_size, bias=False) if in_features != hidden_size else None
        self.layers = nn.ModuleList(nn.Linear(in_features if i == 0 else hidden_size, hidden_size)
                                    for i in range(num_layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.zero_()
                layer.bias.zero_()
            if self.residual is not None:
                self.residual.weight.zero_()
                self.residual.weight[:, :hidden_size].copy_(torch.eye(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            skip = self.residual(x) if i == 0 and self.residual is not None else x
            x = skip + F.silu(layer(x))
        return x


class HydraHeads(nn.Module):
    """K Hydra heads (see the module docstring).

    Parameters:
        heads: ``K`` :class:`HydraHead` MLPs (head k's input is ``spec.in_features(k)`` wide).
        lm_head_weight: ``[K, V', H]`` per-head projections, or absent when ``share_lm_head``.
        token_map (buffer): ``[V']`` long, head-vocabulary index -> base token id, only with a reduced vocabulary.
    """

    def __init__(self, spec: HydraSpec, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(spec, HydraSpec):
            raise TypeError(f"HydraHeads needs a HydraSpec, got {type(spec).__name__}")
        self.spec = spec
        self.heads = nn.ModuleList(HydraHead(spec.in_features(k), spec.hidden_size, spec.num_layers)
                                   for k in range(spec.num_heads))
        if spec.share_lm_head:
            self.register_parameter("lm_head_weight", None)
        else:
            self.lm_head_weight = nn.Parameter(torch.zeros(spec.num_heads, spec.out_size, spec.hidden_size))
        register_token_map(self, spec, token_map)

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0].layers[0].weight.dtype

    @torch.no_grad()
    def init_from_lm_head(self, base_lm_head_weight: torch.Tensor) -> None:
        """Copy the base lm_head ``[V, H]`` (its ``token_map`` rows) into every head's projection."""
        copy_lm_head(self.lm_head_weight, self.token_map, base_lm_head_weight)

    def features(self, k: int, hidden: torch.Tensor, path_embeds: torch.Tensor) -> torch.Tensor:
        """Head k's features: ``hidden [..., H]`` and ``path_embeds [..., k + 1, H]`` (the embeddings of tokens
        t+1 .. t+k+1) -> ``[..., H]``, in the heads' dtype.

        Raises:
            ValueError: ``path_embeds`` does not hold k + 1 embeddings of width H per position.
        """
        H = self.spec.hidden_size
        if path_embeds.shape[-2:] != (k + 1, H) or path_embeds.shape[:-2] != hidden.shape[:-1]:
            raise ValueError(f"head {k} needs path_embeds [..., {k + 1}, {H}] matching hidden {tuple(hidden.shape)}, "
                             f"got {tuple(path_embeds.shape)}")
        hidden, path_embeds = hidden.to(self.dtype), path_embeds.to(self.dtype)
        if self.spec.combine == "concat":
            x = torch.cat([hidden, path_embeds.flatten(-2)], dim=-1)  # [..., (k + 2) H]
        else:
            x = hidden + path_embeds.sum(dim=-2)
        return self.heads[k](x)

    def forward(self, hidden: torch.Tensor, path_embeds: torch.Tensor,
                base_lm_head_weight: torch.Tensor | None = None, project_fn: ProjectFn | None = None) -> Any:
        """All heads' logits, teacher forced: ``hidden [..., H]`` and ``path_embeds [..., K, H]`` (embeddings of the
        tokens t+1 .. t+K; head k reads the first k + 1) -> ``[K, ..., V']``.

        With ``project_fn`` (training's chunked loss): ``project_fn(features [K, ..., H], weight)`` instead, as
        :meth:`medusa_train.drafters.medusa.heads.MedusaHeads.forward`.

        Raises:
            ValueError: ``share_lm_head`` without ``base_lm_head_weight [V, H]``, or mis-shaped ``path_embeds``.
        """
        K = self.spec.num_heads
        if path_embeds.shape[-2] != K:
            raise ValueError(f"path_embeds must hold K={K} embeddings per position, got {tuple(path_embeds.shape)}")
        features = torch.stack([self.features(k, hidden, path_embeds[..., : k + 1, :]) for k in range(K)])
        if project_fn is not None:
            return project_fn(features, projection_weight(self.lm_head_weight, self.token_map, base_lm_head_weight))
        return project_features(features, self.lm_head_weight, self.token_map, base_lm_head_weight)

    def head_logits(self, k: int, hidden: torch.Tensor, path_embeds: torch.Tensor,
                    base_lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Head k alone: ``hidden [..., H]``, ``path_embeds [..., k + 1, H]`` -> ``[..., V']`` (one level of a tree)."""
        weight = None if self.lm_head_weight is None else self.lm_head_weight[k : k + 1]
        return project_features(self.features(k, hidden, path_embeds)[None], weight, self.token_map,
                                base_lm_head_weight)[0]

    def to_base_tokens(self, head_token_ids: torch.Tensor) -> torch.Tensor:
        """Map head-vocabulary indices (any shape, long) to base token ids; the identity without a token map."""
        return head_token_ids if self.token_map is None else self.token_map[head_token_ids]


def hydra_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None) -> torch.Tensor:
    """Head k reads the final hidden state and the embeddings of the path tokens t+1 .. t+k+1: ``[K', ..., V']``
    (every head runs; the first ``num_heads`` are returned)."""
    logits = heads(inputs.features[FINAL], inputs.embed(inputs.path_tokens), inputs.lm_head_weight)
    return logits if num_heads is None else logits[:num_heads]


def hydra_projected(heads: nn.Module, inputs: TargetInputs, num_heads: int | None, project_fn: ProjectFn) -> Any:
    """:func:`hydra_logits` with the projection replaced by ``project_fn`` (all K heads; ``num_heads`` None)."""
    if num_heads is not None:
        raise ValueError("Hydra heads' projected features are those of all K heads (num_heads=None)")
    return heads(inputs.features[FINAL], inputs.embed(inputs.path_tokens), inputs.lm_head_weight,
                 project_fn=project_fn)



__all__ = ["COMBINES", "HydraHead", "HydraHeads", "HydraSpec", "hydra_logits", "hydra_projected"]
