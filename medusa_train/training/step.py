"""One batch through the frozen base and the heads: the single code path shared by training and evaluation.

A batch either holds token ids (``input_ids``, ``attention_mask``, ``labels``: the base model runs here, under
``no_grad``) or cached base outputs (``hidden``, ``base_argmax``, ``labels`` and ``input_ids`` from
:mod:`hidden_cache`: the base never runs). Either way the heads see the same last hidden states, and the targets come
from the same frozen lm_head. Hydra heads also read the path tokens t+1 .. t+k+1, teacher forced: the batch's own
tokens (on self-distilled data, the base model's own greedy tokens), through the base's frozen input embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.drafters.catalog import TargetInputs, drafter_type, shifted_path_tokens
from medusa_train.features import FINAL, feature_layer, target_features
from medusa_train.training.losses import (
    IGNORE_INDEX,
    HeadLossOutput,
    head_targets,
    labelled_tokens,
    packed_head_loss,
    valid_mask,
)

# The batch key (and hidden-cache shard tensor name) of the last hidden state (FINAL); other features keep their names.
HIDDEN_KEY = "hidden"


def feature_key(name: str) -> str:
    """The batch key (and hidden-cache shard tensor name) of target feature ``name``: ``hidden`` for :data:`FINAL`,
    else the name itself (``layer3``)."""
    return HIDDEN_KEY if name == FINAL else name


@dataclass(frozen=True)
class FrozenBase:
    """The parts of the frozen base model that Medusa-1 training uses.

    Attributes:
        backbone: ``base.base_model`` (its ``last_hidden_state`` is after the final norm), or None when training from
            the hidden-state cache.
        lm_head: ``base.get_output_embeddings()``, weight ``[V, H]``; base logits are ``lm_head(hidden)`` (the model
            wrapper refuses architectures where they are not, see ``medusa_train.model.check_supported``).
        embed: ``base.get_input_embeddings()`` (Hydra heads read the path tokens through it), or None.
    """

    backbone: nn.Module | None
    lm_head: nn.Module
    embed: nn.Module | None = None

    @classmethod
    def of(cls, base: PreTrainedModel, keep_backbone: bool = True) -> FrozenBase:
        return cls(backbone=base.base_model if keep_backbone else None, lm_head=base.get_output_embeddings(),
                   embed=base.get_input_embeddings())

    @torch.no_grad()
    def path_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [...]`` long -> the base's input embeddings ``[..., H]`` (frozen).

        Raises:
            RuntimeError: built without the input embeddings.
        """
        if self.embed is None:
            raise RuntimeError("this FrozenBase has no input embeddings (embed): Hydra heads need them")
        return self.embed(tokens)

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [B, T]`` long -> last hidden states ``[B, T, H]`` in the base dtype.

        Raises:
            RuntimeError: built without a backbone (hidden-state cache mode) and asked for hidden states.
        """
        if self.backbone is None:
            raise RuntimeError("this FrozenBase has no backbone (hidden-state cache mode): batches must hold 'hidden'")
        return target_features(self.backbone, input_ids, attention_mask=attention_mask, use_cache=False)[0][FINAL]

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``input_ids [B, T]`` long -> the named target features (:mod:`medusa_train.features`) ``[B, T, H]`` each,
        :data:`FINAL` always, in the base dtype (one backbone pass).

        Raises:
            RuntimeError: built without a backbone (hidden-state cache mode).
        """
        if self.backbone is None:
            raise RuntimeError(f"this FrozenBase has no backbone (hidden-state cache mode): batches must hold "
                               f"{[feature_key(n) for n in names]}")
        layers = [i for i in map(feature_layer, names) if i is not None]
        return target_features(self.backbone, input_ids, layers, attention_mask=attention_mask, use_cache=False)[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` -> base logits ``[B, T, V]`` (the lm_head's dtype)."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    @torch.no_grad()
    def logits_at(self, hidden: torch.Tensor, b: torch.Tensor, t: torch.Tensor,
                  token_map: torch.Tensor | None = None) -> torch.Tensor:
        """Base logits at positions ``(b[i], t[i])`` of ``hidden [B, T, H]``, over the vocabulary ``token_map [V']``
        (None: all V): ``[R, V']`` float32. Each distinct position is projected once (heads share them)."""
        flat, inverse = torch.unique(b * hidden.shape[1] + t, return_inverse=True)
        rows = hidden.reshape(-1, hidden.shape[-1])[flat].to(self.lm_head.weight.dtype)  # [U, H]
        weight = self.lm_head.weight if token_map is None else self.lm_head.weight[token_map.to(rows.device)]
        return (rows @ weight.T).float()[inverse]


@dataclass(frozen=True)
class LossSpec:
    """What the loss needs to know about the heads and the training target.

    Attributes:
        target: ``labels``, ``base_argmax`` or ``soft`` (see :mod:`medusa_train.training.losses`).
        decay: head k's weight is ``decay ** k``.
        share_lm_head: the heads project with the base lm_head (passed to the heads' forward).
        vocab_size: V of the base model.
        num_heads: K.
        token_map: ``[V']`` long reduced head vocabulary, or None.
        head_type: the heads' registered type (:mod:`medusa_train.drafters.catalog`: what they read and how their
            logits are computed).
        features: the target features the heads read (``DrafterType.feature_names(spec)``): from the batch (the
            hidden cache's keys, :func:`feature_key`) or computed by the base.
    """

    target: str
    decay: float
    share_lm_head: bool
    vocab_size: int
    num_heads: int
    token_map: torch.Tensor | None = None
    head_type: str = "medusa"
    features: tuple[str, ...] = (FINAL,)


def heads_on_batch(
    heads: nn.Module,
    base: FrozenBase,
    batch: dict[str, Any],
    spec: LossSpec,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[HeadLossOutput, torch.Tensor]:
    """Run the heads on one batch and compute the loss.

    The heads run only at the positions some head is trained on
    (:func:`~medusa_train.training.losses.packed_head_loss`): padding and prompt tokens, often half of a chat batch,
    never reach the vocabulary projection. ``soft`` targets project the base's hidden states only at the positions
    whose distributions are targets, onto the head vocabulary only.

    Args:
        heads: heads of ``spec.head_type`` or their DDP/DeepSpeed wrapper, called through the type's
            :attr:`~medusa_train.drafters.catalog.DrafterType.logits`.
        base: the frozen base.
        batch: ``labels [B, T]`` and either ``input_ids [B, T]`` (+ ``attention_mask``) or the cached features
            ``spec.features`` (``hidden [B, T, H]``, ``layer<i> [B, T, H]``, :func:`feature_key`; + ``base_argmax
            [B, T]``; heads that read the path need ``input_ids [B, T]`` too, the path tokens).
        spec: loss settings.
        normalizer: see :func:`~medusa_train.training.losses.medusa_head_loss`.

    Returns:
        ``(loss output, head logits)``: head logits ``[K, M, V']`` at the M counted positions.
    """
    labels = batch["labels"]
    names = (FINAL, *(n for n in spec.features if n != FINAL))
    features = {n: batch[feature_key(n)] for n in names if feature_key(n) in batch}
    base_argmax = batch.get("base_argmax")
    with torch.no_grad():
        if len(features) < len(names):
            features = base.features(batch["input_ids"], batch.get("attention_mask"), names)
        hidden = features[FINAL]
        if spec.target != "labels" and base_argmax is None:
            base_argmax = base.logits(hidden).argmax(-1)
    lm_weight = base.lm_head.weight if spec.share_lm_head else None
    targets = head_targets(labels, spec.num_heads, target=spec.target, base_argmax=base_argmax)  # [K, B, T]
    b, t = counted_positions(labels, spec.num_heads)  # [M] positions some head counts
    targets = targets[:, b, t]  # [K, M]
    entry = drafter_type(spec.head_type)
    path = shifted_path_tokens(batch["input_ids"], spec.num_heads) if entry.reads_path else None  # [B, T, K]
    if entry.sequence:  # whole sequences in, the logits at (b, t) out
        inputs = TargetInputs(features=features, path_tokens=path, embed=base.path_embeddings,
                              lm_head_weight=lm_weight, attention_mask=batch.get("attention_mask"), positions=(b, t))
    else:
        inputs = TargetInputs(features={FINAL: hidden[b, t]}, path_tokens=None if path is None else path[b, t],
                              embed=base.path_embeddings, lm_head_weight=lm_weight)
    head_logits = entry.logits(heads, inputs, None)  # [K, M, V']
    if normalizer is None:
        normalizer = labelled_tokens(labels)
    out = packed_loss(head_logits, targets, b, t, spec, normalizer,
                      lambda rows, cols: base.logits_at(hidden, rows, cols, spec.token_map))
    return out, head_logits


def packed_loss(
    head_logits: torch.Tensor,
    targets: torch.Tensor,
    b: torch.Tensor,
    t: torch.Tensor,
    spec: LossSpec,
    normalizer: torch.Tensor | float,
    base_logits_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> HeadLossOutput:
    """The heads' loss at the M positions some head counts, for Medusa-1 and Medusa-2 alike.

    Args:
        head_logits: ``[K, M, V']`` head logits at positions ``(b[m], t[m])``.
        targets: ``[K, M]`` long base ids there (:func:`~medusa_train.training.losses.head_targets`; -100: not
            counted).
        b, t: ``[M]`` long, the positions' batch rows and time steps.
        spec: loss settings.
        normalizer: the labelled tokens to divide by (see :func:`~medusa_train.training.losses.medusa_head_loss`).
        base_logits_at: ``(rows [R], cols [R]) -> [R, V']`` base logits there over the head vocabulary, constants
            (read only for ``soft`` targets: the base's distribution for token t + k + 2 is its logits at t + k + 1).

    Returns:
        :class:`~medusa_train.training.losses.HeadLossOutput`, equal to the dense loss on the same batch.
    """
    base_next = None
    if spec.target == "soft":
        k, m = (targets != IGNORE_INDEX).nonzero(as_tuple=True)  # the counted rows, head-major
        base_next = base_logits_at(b[m], t[m] + k + 1)  # [R, V']
    return packed_head_loss(head_logits, targets, decay=spec.decay, normalizer=normalizer,
                            token_map=spec.token_map, vocab_size=spec.vocab_size, base_next=base_next)


def counted_positions(labels: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``labels [B, T]`` -> ``(b, t)``, each ``[M]`` long: the positions some head is trained on (whatever the
    target: which heads count at t depends on the labels only, :func:`~medusa_train.training.losses.valid_mask`)."""
    b, t = valid_mask(labels, num_heads).any(0).nonzero(as_tuple=True)
    return b, t


def real_tokens(batch: dict[str, Any]) -> torch.Tensor | int:
    """Non-padding tokens in a batch: the ``attention_mask`` sum (a tensor, not synchronised), else all positions."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    return int(batch["labels"].numel())
