"""The Medusa model: a Hugging Face causal LM plus draft heads (Medusa or Hydra), sharing one backbone pass.

The base model is used through transformers' public surface only: ``base.base_model`` (the backbone, whose
``last_hidden_state`` is taken after the final norm), ``get_output_embeddings()`` (the lm_head) and the usual
``attention_mask`` / ``position_ids`` / ``cache`` arguments, so every architecture whose logits are
``lm_head(last_hidden_state)`` works without a patched modeling file (Llama, Mistral, Qwen2, Gemma, GPT-2, GPT-NeoX).
Architectures that post-process logits (e.g. Gemma-2's final soft-capping) are refused by :func:`check_supported`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.features import FINAL, target_features
from medusa_train.head_types import DraftHeads, heads_from_spec
from medusa_train.heads import HeadsSpec
from medusa_train.hydra_heads import HydraHeads, HydraSpec, shifted_path_tokens

# config attributes that change logits after the lm_head; we compute logits as lm_head(hidden) and must refuse these.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def check_supported(base: PreTrainedModel) -> None:
    """Raise ``ValueError`` if ``base`` computes logits other than ``lm_head(last_hidden_state)``."""
    cfg = base.config
    for attr in _LOGIT_POSTPROCESSING:
        value = getattr(cfg, attr, None)
        if value not in (None, 1.0, 1):
            raise ValueError(
                f"{type(base).__name__} post-processes logits ({attr}={value}); Medusa heads need logits equal to "
                "lm_head(last_hidden_state). This architecture is not supported yet."
            )
    if base.get_output_embeddings() is None:
        raise ValueError(f"{type(base).__name__} has no lm_head (get_output_embeddings() is None); use a *ForCausalLM")


@dataclass
class MedusaOutput:
    """Outputs of one :meth:`MedusaModel.forward`.

    Attributes:
        logits: ``[B, T, V]`` base-model logits.
        head_logits: ``[K, B, T, V']`` head logits (None when not asked for; Hydra heads teacher forced on
            ``input_ids``, see :meth:`MedusaModel.forward`).
        hidden_states: ``[B, T, H]`` last hidden states after the final norm.
        past_key_values: the updated cache, when one was passed or ``use_cache``.
    """

    logits: torch.Tensor
    head_logits: torch.Tensor | None
    hidden_states: torch.Tensor
    past_key_values: Any = None


class MedusaModel(nn.Module):
    """Base causal LM + draft heads: :class:`~medusa_train.heads.MedusaHeads` or
    :class:`~medusa_train.hydra_heads.HydraHeads` (which also read the base's input embeddings of the path tokens).

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

    @property
    def head_type(self) -> str:
        """``"medusa"`` or ``"hydra"``."""
        return self.heads.spec.head_type

    def _shared_weight(self) -> torch.Tensor | None:
        return self.lm_head.weight if self.heads.spec.share_lm_head else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The base model's input embeddings of ``tokens [...]`` long: ``[..., H]`` (what Hydra heads read)."""
        return self.base.get_input_embeddings()(tokens)

    def head_logits(self, hidden: torch.Tensor, path_tokens: torch.Tensor | None = None,
                    num_heads: int | None = None) -> torch.Tensor:
        """``[..., H]`` -> ``[K, ..., V']`` logits of all heads (one batched product per layer, see heads.py).

        Args:
            hidden: ``[..., H]`` last hidden states at positions t.
            path_tokens: Hydra heads only, ``[..., K]`` long, the tokens t+1 .. t+K (head k reads the first k + 1).
            num_heads: Medusa heads only, K' <= K: the first K' heads' logits ``[K', ..., V']`` (what a tree of
                depth K' reads); None: all.

        Raises:
            ValueError: Hydra heads without ``path_tokens``, or Medusa heads given some.
        """
        if isinstance(self.heads, HydraHeads):
            if path_tokens is None:
                raise ValueError("Hydra heads read the path tokens t+1 .. t+k+1: pass path_tokens [..., K], or "
                                 "draft level by level with head_logits_at()")
            return self.heads(hidden, self.embed(path_tokens), self._shared_weight())
        if path_tokens is not None:
            raise ValueError("Medusa heads read the hidden state alone: path_tokens is for Hydra heads")
        return self.heads(hidden, self._shared_weight(), num_heads)

    def head_logits_at(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        """Hydra head k alone: ``hidden [..., H]`` and ``path_tokens [..., k + 1]`` long (tokens t+1 .. t+k+1) ->
        ``[..., V']``.

        Raises:
            TypeError: the heads are Medusa heads (they have no path input).
        """
        if not isinstance(self.heads, HydraHeads):
            raise TypeError("head_logits_at drafts one level of Hydra heads; these are Medusa heads: use head_logits")
        return self.heads.head_logits(k, hidden, self.embed(path_tokens), self._shared_weight())

    def forward(
        self, input_ids: torch.Tensor, with_heads: bool = True, **kwargs: Any
    ) -> MedusaOutput:
        """One backbone pass; base logits and (optionally) head logits from the same hidden states.

        Hydra heads are teacher forced: head k at position t reads ``input_ids[t+1 .. t+k+1]`` as its path (the true
        tokens), so ``head_logits`` is meaningful where that path lies inside ``input_ids`` (t + k + 1 < T); later
        positions read padding (token 0).

        Args:
            input_ids: ``[B, T]`` long.
            with_heads: compute head logits ``[K, B, T, V']``.
            **kwargs: passed to the backbone (see :meth:`hidden`).
        """
        hidden, cache = self.hidden(input_ids, **kwargs)
        logits = self.lm_head(hidden)
        heads = None
        if with_heads:
            path = shifted_path_tokens(input_ids, self.heads.spec.num_heads) if self.head_type == "hydra" else None
            heads = self.head_logits(hidden, path)
        return MedusaOutput(logits=logits, head_logits=heads, hidden_states=hidden, past_key_values=cache)


def base_sizes(base: PreTrainedModel) -> tuple[int, int]:
    """(H, V) of a base model, read from its lm_head weight ``[V, H]`` (config names differ between families)."""
    weight = base.get_output_embeddings().weight
    return int(weight.shape[1]), int(weight.shape[0])


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
    combine: str = "concat",
) -> DraftHeads:
    """Fresh heads for ``base``: zero blocks (identity), projections copied from the base lm_head.

    Args:
        head_type: ``medusa`` (:class:`~medusa_train.heads.MedusaHeads`) or ``hydra``
            (:class:`~medusa_train.hydra_heads.HydraHeads`, with ``combine`` one of ``concat``, ``sum``).

    Raises:
        ValueError: ``num_heads < 1`` or ``num_layers < 1`` (field named ``medusa_num_heads``/``medusa_num_layers``),
            an unknown ``head_type`` or ``combine``.
    """
    hidden_size, vocab_size = base_sizes(base)
    fields = dict(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                  share_lm_head=share_lm_head, head_vocab_size=None if token_map is None else int(token_map.numel()))
    if head_type == "hydra":
        spec: HeadsSpec = HydraSpec(**fields, combine=combine)
    elif head_type == "medusa":
        spec = HeadsSpec(**fields)
    else:
        raise ValueError(f"head_type must be medusa or hydra, got {head_type!r}")
    heads = heads_from_spec(spec, token_map)
    heads.init_from_lm_head(base.get_output_embeddings().weight.detach().float())
    device = base.get_output_embeddings().weight.device
    return heads.to(device=device, dtype=dtype or torch.float32)

