"""One batch through the frozen base and the heads: the single code path shared by training and evaluation.

A batch either holds token ids (``input_ids``, ``attention_mask``, ``labels``: the base model runs here, under
``no_grad``) or cached base outputs (``hidden``, ``base_argmax``, ``labels`` and ``input_ids`` from
:mod:`hidden_cache`: the base never runs). Either way the heads see the same last hidden states, and the targets come
from the same frozen lm_head. Hydra heads also read the path tokens t+1 .. t+k+1, teacher forced: the batch's own
tokens (on self-distilled data, the base model's own greedy tokens), through the base's frozen input embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.config.schema import TrainerConfig
from medusa_train.models.catalog import ProjectFn, TargetInputs, drafter_type, shifted_path_tokens
from medusa_train.models.features import FINAL, feature_layer, target_features
from medusa_train.training.chunked_loss import TeacherFn, chunked_argmax, linear_teacher, rows_teacher
from medusa_train.training.losses import (
    IGNORE_INDEX,
    HeadLossOutput,
    head_targets,
    labelled_tokens,
    packed_head_loss,
    projected_head_loss,
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
            wrapper refuses architectures where they are not, see ``medusa_train.models.speculative.check_supported``).
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
        """``input_ids [B, T]`` long -> the named target features (:mod:`medusa_train.models.features`) ``[B, T, H]`` each,
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
    def argmax(self, hidden: torch.Tensor, chunk_size: int = 0) -> torch.Tensor:
        """``[B, T, H]`` -> the base's greedy tokens ``[B, T]`` long, ``chunk_size`` positions projected at a time
        (0: all at once, ``[B, T, V]`` logits)."""
        return chunked_argmax(self.logits, hidden, chunk_size)


@dataclass(frozen=True)
class BaseDistributions:
    """The base's logits over the head vocabulary, where ``soft`` targets read them: computed from its last hidden
    states and lm_head (Medusa-1: ``hidden`` and ``weight``) or read from logits already computed (Medusa-2:
    ``logits``). Constants (no gradient).

    Attributes:
        hidden: ``[B, T, H]`` last hidden states, with ``weight`` ``[V, H]`` the base lm_head's; or None.
        weight: see ``hidden``.
        logits: ``[B, T, V]`` base logits, or None (``hidden`` given).
        token_map: ``[V']`` long head vocabulary, or None (all V).
    """

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    token_map: torch.Tensor | None = None

    def _weight(self) -> torch.Tensor:
        w = self.weight.detach()
        return w if self.token_map is None else w[self.token_map.to(w.device)]

    @torch.no_grad()
    def at(self, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Base logits at positions ``(b[i], t[i])`` (``[R]`` long each): ``[R, V']`` float32. From hidden states,
        each distinct position is projected once (heads share them)."""
        if self.logits is not None:
            block = self.logits[b, t]
            return (block if self.token_map is None else block[:, self.token_map.to(block.device)]).float()
        flat, inverse = torch.unique(b * self.hidden.shape[1] + t, return_inverse=True)
        weight = self._weight()
        rows = self.hidden.reshape(-1, self.hidden.shape[-1])[flat].to(weight.dtype)  # [U, H]
        return (rows @ weight.T).float()[inverse]

    def teacher(self, b: torch.Tensor, t: torch.Tensor) -> TeacherFn:
        """The same rows as :meth:`at`, read one chunk at a time by the chunked loss (never ``[R, V']`` at once)."""
        if self.logits is not None:
            return rows_teacher(self.logits, b, t, self.token_map)
        return linear_teacher(self.hidden[b, t], self._weight())


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
        head_type: the heads' registered type (:mod:`medusa_train.models.catalog`: what they read and how their
            logits are computed).
        features: the target features the heads read (``DrafterType.feature_names(spec)``): from the batch (the
            hidden cache's keys, :func:`feature_key`) or computed by the base.
        loss_chunk_size: rows (one head at one position) projected onto the vocabulary at once
            (``trainer.loss_chunk_size``; :mod:`medusa_train.training.chunked_loss`); 0: all at once, the head logits
            ``[K, M, V']`` held (types without :attr:`~medusa_train.models.catalog.DrafterType.projected` always).
    """

    target: str
    decay: float
    share_lm_head: bool
    vocab_size: int
    num_heads: int
    token_map: torch.Tensor | None = None
    head_type: str = "medusa"
    features: tuple[str, ...] = (FINAL,)
    loss_chunk_size: int = TrainerConfig.loss_chunk_size


def heads_on_batch(
    heads: nn.Module,
    base: FrozenBase,
    batch: dict[str, Any],
    spec: LossSpec,
    normalizer: torch.Tensor | float | None = None,
) -> HeadLossOutput:
    """Run the heads on one batch and compute the loss.

    The heads run only at the positions some head is trained on
    (:func:`~medusa_train.training.losses.packed_head_loss`): padding and prompt tokens, often half of a chat batch,
    never reach the vocabulary projection. ``soft`` targets project the base's hidden states only at the positions
    whose distributions are targets, onto the head vocabulary only. With ``spec.loss_chunk_size`` (and a type with
    :attr:`~medusa_train.models.catalog.DrafterType.projected`) the heads hand their features and projection to
    :meth:`HeadTargets.project_fn` inside their forward, which projects ``loss_chunk_size`` rows at a time.

    Args:
        heads: heads of ``spec.head_type`` or their DDP/DeepSpeed wrapper, called through the type's
            :attr:`~medusa_train.models.catalog.DrafterType.logits`.
        base: the frozen base.
        batch: ``labels [B, T]`` and either ``input_ids [B, T]`` (+ ``attention_mask``) or the cached features
            ``spec.features`` (``hidden [B, T, H]``, ``layer<i> [B, T, H]``, :func:`feature_key`; + ``base_argmax
            [B, T]``; heads that read the path need ``input_ids [B, T]`` too, the path tokens).
        spec: loss settings.
        normalizer: see :func:`~medusa_train.training.losses.heads_loss`.

    Returns:
        The loss and the per-head metric sums at the M counted positions.
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
            base_argmax = base.argmax(hidden, spec.loss_chunk_size)
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
    if normalizer is None:
        normalizer = labelled_tokens(labels)
    loss = HeadTargets(targets, b, t, spec, normalizer,
                       BaseDistributions(hidden=hidden, weight=base.lm_head.weight, token_map=spec.token_map))
    if chunks(spec):
        return entry.projected(heads, inputs, None, loss.project_fn())
    return loss.loss(entry.logits(heads, inputs, None))


def chunks(spec: LossSpec) -> bool:
    """Whether the heads' loss projects in chunks: ``spec.loss_chunk_size > 0`` and the type exposes its features
    and projection (:attr:`~medusa_train.models.catalog.DrafterType.projected`)."""
    return spec.loss_chunk_size > 0 and drafter_type(spec.head_type).projected is not None


@dataclass(frozen=True)
class HeadTargets:
    """What the heads' loss at the M positions some head counts needs, for Medusa-1 and Medusa-2 alike.

    Attributes:
        targets: ``[K, M]`` long base ids at positions ``(b[m], t[m])``
            (:func:`~medusa_train.training.losses.head_targets`; -100: not counted).
        b, t: ``[M]`` long, the positions' batch rows and time steps.
        spec: loss settings.
        normalizer: the labelled tokens to divide by (see :func:`~medusa_train.training.losses.heads_loss`).
        dists: the base's distributions (read only for ``soft`` targets: the base's distribution for token
            t + k + 2 is its logits at t + k + 1).
    """

    targets: torch.Tensor
    b: torch.Tensor
    t: torch.Tensor
    spec: LossSpec
    normalizer: torch.Tensor | float
    dists: BaseDistributions

    def _soft_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of the counted rows' ``soft`` targets, in the rows' (head-major) order."""
        k, m = (self.targets != IGNORE_INDEX).nonzero(as_tuple=True)
        return self.b[m], self.t[m] + k + 1

    def loss(self, head_logits: torch.Tensor) -> HeadLossOutput:
        """The loss from the heads' logits ``[K, M, V']`` held at once (``trainer.loss_chunk_size=0``, or a type
        without projected features): :func:`~medusa_train.training.losses.packed_head_loss`, equal to the dense
        loss on the same batch."""
        spec = self.spec
        base_next = self.dists.at(*self._soft_rows()) if spec.target == "soft" else None  # [R, V']
        return packed_head_loss(head_logits, self.targets, decay=spec.decay, normalizer=self.normalizer,
                                token_map=spec.token_map, vocab_size=spec.vocab_size, base_next=base_next)

    def project_fn(self) -> ProjectFn:
        """The same loss as a :data:`~medusa_train.models.catalog.ProjectFn`: ``(features [K, M, H], weight
        [V', H] or [K, V', H]) -> HeadLossOutput``, projecting ``spec.loss_chunk_size`` rows at a time
        (:func:`~medusa_train.training.losses.projected_head_loss`)."""
        spec = self.spec
        teacher = self.dists.teacher(*self._soft_rows()) if spec.target == "soft" else None

        def project(features: torch.Tensor, weight: torch.Tensor) -> HeadLossOutput:
            return projected_head_loss(features, weight, self.targets, decay=spec.decay, normalizer=self.normalizer,
                                       chunk_size=spec.loss_chunk_size, token_map=spec.token_map,
                                       vocab_size=spec.vocab_size, teacher=teacher)

        return project


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
