"""The speculative model: a Hugging Face causal LM (the target) plus a drafter of any catalog type, sharing one
backbone pass.

The base model is used through transformers' public surface only: ``base.base_model`` (the backbone, whose
``last_hidden_state`` is taken after the final norm), ``get_output_embeddings()`` (the lm_head) and the usual
``attention_mask`` / ``position_ids`` / ``cache`` arguments, so every architecture whose logits are
``lm_head(last_hidden_state)`` works without a patched modeling file (Llama, Mistral, Qwen2, Gemma, GPT-2, GPT-NeoX).
Architectures that post-process logits (e.g. Gemma-2's final soft-capping) are refused by :func:`check_supported`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.models.catalog import TargetInputs, heads_from_spec, new_spec, shifted_path_tokens, titles, type_of
from medusa_train.models.catalog import drafter_types
from medusa_train.models.features import FINAL, feature_layer, target_features
from medusa_train.models.heads_base import HeadsSpec

DraftHeads = nn.Module  # any registered drafter type's module (medusa_train.models.catalog)

# config attributes that change logits after the lm_head; we compute logits as lm_head(hidden) and must refuse these.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def check_supported(base: PreTrainedModel) -> None:
    """Raise ``ValueError`` if ``base`` computes logits other than ``lm_head(last_hidden_state)``."""
    cfg = base.config
    for attr in _LOGIT_POSTPROCESSING:
        value = getattr(cfg, attr, None)
        if value not in (None, 1.0, 1):
            raise ValueError(
                f"{type(base).__name__} post-processes logits ({attr}={value}); the drafters need logits equal to "
                "lm_head(last_hidden_state). This architecture is not supported yet."
            )
    if base.get_output_embeddings() is None:
        raise ValueError(f"{type(base).__name__} has no lm_head (get_output_embeddings() is None); use a *ForCausalLM")


@dataclass
class SpeculativeOutput:
    """Outputs of one :meth:`SpeculativeModel.forward`.

    Attributes:
        logits: ``[B, T, V]`` base-model logits.
        head_logits: ``[K, B, T, V']`` head logits (None when not asked for; Hydra heads teacher forced on
            ``input_ids``, see :meth:`SpeculativeModel.forward`).
        hidden_states: ``[B, T, H]`` last hidden states after the final norm.
        past_key_values: the updated cache, when one was passed or ``use_cache``.
    """

    logits: torch.Tensor
    head_logits: torch.Tensor | None
    hidden_states: torch.Tensor
    past_key_values: Any = None


class SpeculativeModel(nn.Module):
    """Base causal LM + draft heads of any registered type (:mod:`medusa_train.drafters`): e.g.
    :class:`~medusa_train.drafters.medusa.heads.MedusaHeads` or :class:`~medusa_train.drafters.hydra.heads.HydraHeads`
    (which also read the base's input embeddings of the path tokens).

    Args:
        base: any supported ``*ForCausalLM``.
        heads: heads whose hidden and vocabulary sizes match ``base`` (checked).

    Raises:
        ValueError: hidden size or vocabulary mismatch, or an unsupported architecture.
    """

    def __init__(self, base: PreTrainedModel, heads: DraftHeads) -> None:
        super().__init__()
        check_supported(base)
        check_heads_match_base(heads.spec, base)
        self.base = base
        self.heads = heads

    @property
    def lm_head(self) -> nn.Module:
        return self.base.get_output_embeddings()

    @property
    def backbone(self) -> nn.Module:
        return self.base.base_model

    def hidden(self, input_ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """Backbone pass: ``input_ids [B, T]`` -> (last hidden states ``[B, T, H]``, past_key_values).

        ``kwargs`` go to the backbone (``attention_mask`` 2-D or a custom 4-D mask, ``position_ids``, ``cache`` (a
        transformers ``Cache``; transformers 5.24 renamed ``past_key_values`` to ``cache``), ``use_cache``).
        """
        features, cache = target_features(self.backbone, input_ids, **kwargs)
        return features[FINAL], cache

    def features(self, input_ids: torch.Tensor, **kwargs: Any) -> tuple[dict[str, torch.Tensor], Any]:
        """Backbone pass: ``input_ids [B, T]`` -> (the named target features the heads' type reads, each
        ``[B, T, H]``, :attr:`~medusa_train.models.catalog.DrafterType.features`, ``final`` always; the cache).

        The same function (:func:`medusa_train.models.features.target_features`) feeds training, tuning and decoding.
        ``kwargs`` as :meth:`hidden`.
        """
        names = {FINAL, *type_of(self.heads.spec).feature_names(self.heads.spec)}
        layers = sorted(i for i in map(feature_layer, names) if i is not None)
        return target_features(self.backbone, input_ids, layers, **kwargs)

    @property
    def head_type(self) -> str:
        """The heads' registered type (:mod:`medusa_train.models.catalog`), e.g. ``"medusa"``."""
        return type_of(self.heads.spec).name

    def _shared_weight(self) -> torch.Tensor | None:
        return self.lm_head.weight if self.heads.spec.share_lm_head else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The base model's input embeddings of ``tokens [...]`` long: ``[..., H]`` (what Hydra heads read)."""
        return self.base.get_input_embeddings()(tokens)

    def target_inputs(self, hidden: torch.Tensor | Mapping[str, torch.Tensor], path_tokens: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> TargetInputs:
        """What the heads read at positions ``[...]``: the final hidden state ``hidden [..., H]`` (or the named
        features, :meth:`features`), the path tokens ``[..., K]`` long (for types that read them), the input
        embeddings, the shared lm_head and (whole sequences) the ``attention_mask [B, T]``."""
        features = {FINAL: hidden} if isinstance(hidden, torch.Tensor) else dict(hidden)
        return TargetInputs(features=features, path_tokens=path_tokens, embed=self.embed,
                            lm_head_weight=self._shared_weight(), attention_mask=attention_mask)

    def head_logits(self, hidden: torch.Tensor | Mapping[str, torch.Tensor], path_tokens: torch.Tensor | None = None,
                    num_heads: int | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., H]`` -> ``[K, ..., V']`` logits of all heads, as their type computes them
        (:attr:`~medusa_train.models.catalog.DrafterType.logits`).

        Args:
            hidden: ``[..., H]`` last hidden states at positions t, or the named features the type reads
                (:meth:`features`; a :attr:`~medusa_train.models.catalog.DrafterType.sequence` type, EAGLE-3,
                needs them, ``[B, T, H]`` each: whole sequences).
            path_tokens: for types that read the path (Hydra, EAGLE-3), ``[..., K]`` long, the tokens t+1 .. t+K
                (head k reads the first k + 1).
            num_heads: K' <= K: the first K' heads' logits ``[K', ..., V']`` (what a tree of depth K' reads), for
                types that compute heads independently (Medusa); None: all.
            attention_mask: for sequence types, ``[B, T]`` (1 real, 0 padding); None: all real.

        Raises:
            ValueError: heads that read the path without ``path_tokens``, or others given some; a feature the type
                reads missing.
        """
        entry = type_of(self.heads.spec)
        features = {FINAL: hidden} if isinstance(hidden, torch.Tensor) else hidden
        missing = [n for n in entry.feature_names(self.heads.spec) if n not in features]
        if missing:
            raise ValueError(f"{entry.title} heads read the target features {missing}: pass them by name, "
                             "{name: [B, T, H]} as SpeculativeModel.features gives them")
        if entry.reads_path and path_tokens is None:
            raise ValueError(f"{entry.title} heads read the path tokens t+1 .. t+k+1: pass path_tokens [..., K], or "
                             "draft level by level with head_logits_at()")
        if not entry.reads_path and path_tokens is not None:
            readers = [e for e in drafter_types() if e.reads_path]
            raise ValueError(f"{entry.title} heads read the hidden state alone: path_tokens is for "
                             f"{titles(readers)} heads")
        return entry.logits(self.heads, self.target_inputs(hidden, path_tokens, attention_mask), num_heads)

    def head_logits_at(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        """Head k alone, for heads drafted level by level (Hydra: ``heads.head_logits``): ``hidden [..., H]`` and
        ``path_tokens [..., k + 1]`` long (tokens t+1 .. t+k+1) -> ``[..., V']``.

        Raises:
            TypeError: the heads have no per-level call (e.g. Medusa heads: use head_logits).
        """
        if not callable(getattr(self.heads, "head_logits", None)):
            raise TypeError(f"head_logits_at drafts one level of heads that read the path; these are "
                            f"{type_of(self.heads.spec).title} heads: use head_logits")
        return self.heads.head_logits(k, hidden, self.embed(path_tokens), self._shared_weight())

    def forward(
        self, input_ids: torch.Tensor, with_heads: bool = True, **kwargs: Any
    ) -> SpeculativeOutput:
        """One backbone pass; base logits and (optionally) head logits from the same hidden states.

        Hydra heads are teacher forced: head k at position t reads ``input_ids[t+1 .. t+k+1]`` as its path (the true
        tokens), so ``head_logits`` is meaningful where that path lies inside ``input_ids`` (t + k + 1 < T); later
        positions read padding (token 0). EAGLE-3 drafters (sequence types) read the features they declare
        (:meth:`features`) over the whole sequence, their draft steps unrolled teacher forced the same way.

        Args:
            input_ids: ``[B, T]`` long.
            with_heads: compute head logits ``[K, B, T, V']``.
            **kwargs: passed to the backbone (see :meth:`hidden`).
        """
        entry = type_of(self.heads.spec)
        if with_heads and entry.sequence:
            features, cache = self.features(input_ids, **kwargs)
            hidden = features[FINAL]
        else:
            hidden, cache = self.hidden(input_ids, **kwargs)
        logits = self.lm_head(hidden)
        heads = None
        if with_heads:
            path = shifted_path_tokens(input_ids, self.heads.spec.num_heads) if entry.reads_path else None
            if entry.sequence:
                mask = kwargs.get("attention_mask")
                heads = self.head_logits(features, path, attention_mask=mask if mask is None or mask.dim() == 2
                                         else None)
            else:
                heads = self.head_logits(hidden, path)
        return SpeculativeOutput(logits=logits, head_logits=heads, hidden_states=hidden, past_key_values=cache)


def base_sizes(base: PreTrainedModel) -> tuple[int, int]:
    """(H, V) of a base model, read from its lm_head weight ``[V, H]`` (config names differ between families; a
    weight partitioned by DeepSpeed ZeRO-3 keeps its full shape in ``ds_shape``)."""
    weight = base.get_output_embeddings().weight
    shape = getattr(weight, "ds_shape", weight.shape)
    return int(shape[1]), int(shape[0])


def check_heads_match_base(spec: HeadsSpec, base: PreTrainedModel) -> None:
    """Raise ``ValueError`` naming the field when heads were built for another base model."""
    hidden_size, vocab_size = base_sizes(base)
    name = getattr(base.config, "_name_or_path", "") or type(base).__name__
    kind = spec.head_type.capitalize()
    if spec.hidden_size != hidden_size:
        raise ValueError(
            f"{kind} heads have hidden_size={spec.hidden_size} but the base model {name!r} has {hidden_size}: "
            "these heads were trained for another base model (check base_model_name_or_path in the export's config.json)"
        )
    if spec.vocab_size != vocab_size:
        raise ValueError(
            f"{kind} heads have vocab_size={spec.vocab_size} but the base model {name!r} has {vocab_size}: "
            "these heads were trained for another base model (check base_model_name_or_path in the export's config.json)"
        )


def new_heads_for(
    base: PreTrainedModel,
    num_heads: int,
    num_layers: int = 1,
    share_lm_head: bool = False,
    token_map: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    head_type: str = "medusa",
    **options: Any,
) -> DraftHeads:
    """Fresh heads for ``base``: zero blocks (identity), projections copied from the base lm_head.

    Args:
        head_type: a registered drafter type (:mod:`medusa_train.models.catalog`): ``medusa``
            (:class:`~medusa_train.drafters.medusa.heads.MedusaHeads`), ``hydra``
            (:class:`~medusa_train.drafters.hydra.heads.HydraHeads`) ...
        options: the type's own spec fields (Hydra: ``combine``, one of ``concat``, ``sum``); others are ignored.

    Raises:
        ValueError: ``num_heads < 1`` or ``num_layers < 1`` (the field named),
            an unknown ``head_type`` or an invalid option.
    """
    hidden_size, vocab_size = base_sizes(base)
    spec = new_spec(head_type, options, base.config, num_heads=num_heads, num_layers=num_layers,
                    hidden_size=hidden_size, vocab_size=vocab_size, share_lm_head=share_lm_head,
                    head_vocab_size=None if token_map is None else int(token_map.numel()))
    heads = heads_from_spec(spec, token_map)
    heads.init_from_lm_head(base.get_output_embeddings().weight.detach().float())
    device = base.get_output_embeddings().weight.device
    return heads.to(device=device, dtype=dtype or torch.float32)
