"""Medusa heads: K small residual MLPs on the base model's last hidden state, each followed by a vocabulary projection.

Source: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024),
Sec. 2.1.1, Eq. (1): ``p_t^(k) = softmax(W_2^(k) · (SiLU(W_1^(k) · h_t) + h_t))``. Head k (0-based) reads the last
hidden state at position t and predicts the token at t + k + 2 (the base lm_head already predicts t + 1).

Parameters are stored stacked over heads so that all K heads run in one batched matrix product per residual layer and
one for the projection, instead of K small ones: with a 49k vocabulary the projection dominates, and one stacked
product of ``[K·T, H] x [H, V]`` is about four times faster than K separate ones on a CPU (``benchmarks/head_step.py``). The
FasterDecoding key layout (``{h}.{l}.linear.weight``) is produced on export by :mod:`medusa_train.export`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from medusa_train.drafters.catalog import MEDUSA_LAYOUT, DrafterType, ProjectFn, TargetInputs, register, type_of
from medusa_train.features import FINAL


@dataclass(frozen=True)
class HeadsSpec:
    """Shape of a set of Medusa heads.

    Attributes:
        num_heads: K, ``medusa_num_heads`` (>= 1).
        num_layers: residual blocks per head, ``medusa_num_layers`` (>= 1; FasterDecoding's default is 1).
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
                field = {"num_heads": "medusa_num_heads", "num_layers": "medusa_num_layers"}.get(name, name)
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
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
        """The registered drafter type of this spec's class (:mod:`medusa_train.drafters.catalog`): ``"medusa"``
        here, ``"hydra"`` for :class:`~medusa_train.hydra_heads.HydraSpec`."""
        return type_of(self).name


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


def _medusa_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None,
                   project_fn: ProjectFn | None = None) -> Any:
    """Each head reads the final hidden state alone: ``[K', ..., V']`` (or ``project_fn``'s result)."""
    return heads(inputs.features[FINAL], inputs.lm_head_weight, num_heads, project_fn=project_fn)


MEDUSA = register(DrafterType(
    name="medusa", title="Medusa", spec_cls=HeadsSpec, module_cls=MedusaHeads, logits=_medusa_logits,
    projected=_medusa_logits,
    source="Cai et al. 2024, Medusa, arXiv:2401.10774, Sec. 2.1.1, Eq. (1)",
    joint=True, layout=MEDUSA_LAYOUT, config_keys={"num_heads": "medusa_num_heads", "num_layers": "medusa_num_layers"},
    engines={"fasterdecoding": None, "tgi": None, "vllm": None},
    tree_drafter="inference.proposers.tree_drafters:MedusaTreeDrafter",
))
