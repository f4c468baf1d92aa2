"""Medusa heads: K small residual MLPs on the base model's last hidden state, each followed by a vocabulary projection.

Source: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024),
Sec. 2.1.1, Eq. (1): ``p_t^(k) = softmax(W_2^(k) · (SiLU(W_1^(k) · h_t) + h_t))``. Head k (0-based) reads the last
hidden state at position t and predicts the token at t + k + 2 (the base lm_head already predicts t + 1).

Parameters are stored stacked over heads so that all K heads run in one batched matrix product per residual layer and
one for the projection, instead of K small ones: with a 49k vocabulary the projection dominates, and one stacked
product of ``[K·T, H] x [H, V]`` is about four times faster than K separate ones on a CPU (``benchmarks/head_step.py``). The
FasterDecoding key layout (``{h}.{l}.linear.weight``) is produced on export by :mod:`medusa_train.export` (the
``medusa`` layout, :data:`medusa_train.models.catalog.MEDUSA_LAYOUT`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from medusa_train.models.catalog import ProjectFn, TargetInputs
from medusa_train.models.features import FINAL
from medusa_train.models.heads_base import HeadsSpec, copy_lm_head, project_features, projection_weight, register_token_map


class MedusaHeads(nn.Module):
    """K Medusa heads with stacked parameters.

    Parameters:
        block_weight: ``[K, L, H, H]``, zero-initialised so that every block starts as the identity.
        block_bias: ``[K, L, H]``, zero-initialised (the output is ``x + SiLU(W x + b)`` and ``SiLU(0) = 0``).
        lm_head_weight: ``[K, V', H]`` per-head projections, or absent when ``share_lm_head``.
        token_map (buffer): ``[V']`` long, head-vocabulary index -> base token id, present only with a reduced vocab.
    """

    def __init__(self, spec: HeadsSpec, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec = spec
        K, L, H = spec.num_heads, spec.num_layers, spec.hidden_size
        self.block_weight = nn.Parameter(torch.zeros(K, L, H, H))
        self.block_bias = nn.Parameter(torch.zeros(K, L, H))
        if spec.share_lm_head:
            self.register_parameter("lm_head_weight", None)
        else:
            self.lm_head_weight = nn.Parameter(torch.zeros(K, spec.out_size, H))
        register_token_map(self, spec, token_map)

    @torch.no_grad()
    def init_from_lm_head(self, base_lm_head_weight: torch.Tensor) -> None:
        """Copy the base lm_head ``[V, H]`` (rows of ``token_map`` with a reduced vocab) into every head's projection.

        Medusa initialises each head's projection from the base lm_head so a fresh head predicts what the base predicts
        for t+1, a far better start than random (Medusa paper, Sec. 2.1.1).
        """
        copy_lm_head(self.lm_head_weight, self.token_map, base_lm_head_weight)

    def _count(self, num_heads: int | None) -> int:
        if num_heads is None:
            return self.spec.num_heads
        if not 1 <= num_heads <= self.spec.num_heads:
            raise ValueError(f"num_heads must be in [1, {self.spec.num_heads}] (the heads there are), got {num_heads}")
        return num_heads

    def transform(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Run the residual blocks of all heads (or of the first ``num_heads``).

        Args:
            hidden: ``[..., H]`` base last hidden states (after the final norm), any float dtype.
            num_heads: K' <= K, run only heads ``0 .. K'-1`` (a tree of depth K' reads no others); None: all K.

        Returns:
            ``[K', ..., H]``: head k's features, ``x_{l+1} = x_l + SiLU(W_l x_l + b_l)``.
        """
        lead = hidden.shape[:-1]
        K, H = self._count(num_heads), self.spec.hidden_size
        w, b = self.block_weight[:K], self.block_bias[:K]
        # Inputs follow the heads' dtype (cast the module, never the weights per call).
        x = hidden.to(w.dtype).reshape(1, -1, H).expand(K, -1, H)  # [K, M, H], M = prod(lead)
        for layer in range(self.spec.num_layers):
            # baddbmm: b[:, l] + x @ W[:, l]^T for all K heads in one product.
            x = x + F.silu(torch.baddbmm(b[:, layer, None, :], x, w[:, layer].transpose(1, 2)))
        return x.reshape(K, *lead, H)

    def project(self, features: torch.Tensor, base_lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Project head features to logits (:func:`project_features` with these heads' projections).

        Args:
            features: ``[K', ..., H]`` from :meth:`transform` (the first K' <= K heads); cast to the projection's
                dtype.
            base_lm_head_weight: ``[V, H]``, required when ``share_lm_head``.

        Returns:
            ``[K', ..., V']`` logits over the head vocabulary (V' = V without a token map).

        Raises:
            ValueError: ``share_lm_head`` and no base lm_head weight given.
        """
        K = self._count(features.shape[0])
        weight = self.lm_head_weight[:K] if self.lm_head_weight is not None else None
        return project_features(features, weight, self.token_map, base_lm_head_weight)

    def forward(self, hidden: torch.Tensor, base_lm_head_weight: torch.Tensor | None = None,
                num_heads: int | None = None, project_fn: ProjectFn | None = None) -> Any:
        """All heads' logits (or the first ``num_heads``'): ``[..., H]`` hidden states -> ``[K', ..., V']`` logits
        (see :meth:`transform` and :meth:`project`).

        With ``project_fn`` (training's chunked loss): ``project_fn(features [K', ..., H], weight)`` is returned
        instead, ``weight`` the projection (:func:`projection_weight`); called here, inside ``forward``, so that
        wrappers that gather parameters for the forward pass (DeepSpeed ZeRO-3) hold the weight while it runs."""
        features = self.transform(hidden, num_heads)
        if project_fn is None:
            return self.project(features, base_lm_head_weight)
        weight = self.lm_head_weight
        if weight is not None and features.shape[0] < weight.shape[0]:  # all heads: the parameter itself (ZeRO-3
            weight = weight[: features.shape[0]]  # gathers it again for the backward pass; a view would be empty)
        return project_fn(features, projection_weight(weight, self.token_map, base_lm_head_weight))

    def to_base_tokens(self, head_token_ids: torch.Tensor) -> torch.Tensor:
        """Map head-vocabulary indices (any shape, long) to base token ids; the identity without a token map."""
        return head_token_ids if self.token_map is None else self.token_map[head_token_ids]


def medusa_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None,
                  project_fn: ProjectFn | None = None) -> Any:
    """Each head reads the final hidden state alone: ``[K', ..., V']`` (or ``project_fn``'s result)."""
    return heads(inputs.features[FINAL], inputs.lm_head_weight, num_heads, project_fn=project_fn)



__all__ = ["MedusaHeads", "medusa_logits"]
