"""Building and loading the draft model of speculative decoding: a draft cut from the target's own first layers, a
separate model loaded through a ``model/`` config, and the check that a draft speaks the target's vocabulary. The
proposer that drafts with it is :class:`~inference.proposers.draft_model.DraftModelProposer`.

**Self-layers draft** (:func:`self_layer_draft`): the target's embeddings, its first ``n`` decoder layers, its final
norm and its lm_head, i.e. the target exited early after layer ``n`` (the draft of self-speculative decoding:
Zhang et al. 2024, "Draft & Verify: Lossless Large Language Model Acceleration via Self-Speculative Decoding";
Elhoushi et al. 2024, "LayerSkip", Sec. 4, whose early exit reuses the final norm and lm_head the same way). It is an
ordinary ``*ForCausalLM`` of the target's class built on the ``meta`` device with ``n`` layers, whose submodules are
then *the target's own module objects*: no weight is copied and no memory is allocated, and the draft works with
anything that takes a model (our :class:`~inference.decoders.draft.DraftDecoder`, ``generate(assistant_model=...)``).
The draft keeps its own KV cache; sharing layers shares weights only.

**Config group** ``draft/`` (``inference/conf/draft/``): ``self_layers.yaml`` (``num_layers``) or ``model.yaml`` (a
``model/`` config under ``draft.model``); both set ``num_draft_tokens`` (K) and ``schedule``. :func:`load_draft`
validates the node as a :class:`DraftConfig` before loading anything.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.config.bounds import MAX_COUNT, bound, check_bounds
from medusa_train.loading.cpu_kernels import PackedLinear

DRAFT_KINDS = ("self_layers", "model")
SCHEDULES = ("constant", "heuristic")


def _num_layers(config: Any) -> int:
    value = getattr(config, "num_hidden_layers", None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{type(config).__name__} has no num_hidden_layers; cannot cut a self-layers draft from it")
    return value


def _same_structure(a: nn.Module, b: nn.Module) -> bool:
    """True when two modules hold parameters and buffers under the same names and shapes."""
    def layout(m: nn.Module) -> dict[str, tuple[int, ...]]:
        tensors = dict(m.named_parameters(remove_duplicate=False))
        tensors.update(dict(m.named_buffers(remove_duplicate=False)))
        return {k: tuple(v.shape) for k, v in tensors.items()}

    return type(a) is type(b) and layout(a) == layout(b)


def _share_modules(draft: nn.Module, target: nn.Module) -> None:
    """Replace each child of ``draft`` by ``target``'s child of the same name when their layouts match or the target's
    is the same layer converted to pre-packed kernels; descend into children that differ (the shortened layer list
    and its parents)."""
    for name, child in list(draft.named_children()):
        source = getattr(target, name, None)
        if not isinstance(source, nn.Module):
            continue
        if _same_structure(child, source) or isinstance(source, PackedLinear):
            draft._modules[name] = source
        else:
            _share_modules(child, source)


def self_layer_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A draft made of the target's first ``num_layers`` decoder layers, final norm and lm_head (shared, not copied).

    Args:
        target: a ``*ForCausalLM`` with L = ``config.num_hidden_layers`` layers (Llama, Mistral, Qwen2, Gemma,
            GPT-2, GPT-NeoX, ...), in eval mode.
        num_layers: n, the layers kept, ``1 <= n < L``.

    Returns:
        A ``*ForCausalLM`` of the target's class with ``n`` layers whose every parameter and buffer *is* the
        target's tensor (same storage), in eval mode. Output: ``lm_head(final_norm(h_n))``, h_n the hidden state
        after layer n; logits ``[B, T, V]`` with the target's V.

    Raises:
        ValueError: ``num_layers`` not an int in ``[1, L)`` (the message names it and gives L).
        NotImplementedError: the architecture keeps state outside the shared submodules (a parameter or buffer of
            the draft is not the target's), so it cannot be cut this way.
    """
    total = _num_layers(target.config)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(
            f"num_layers must be an int in [1, {total}) (the target has {total} layers; the draft keeps the first n), "
            f"got {num_layers!r}"
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        draft = type(target)(config)
    _share_modules(draft, target)

    target_tensors = {id(t) for t in target.parameters()} | {id(t) for t in target.buffers()}
    foreign = [name for name, t in [*draft.named_parameters(remove_duplicate=False),
                                    *draft.named_buffers(remove_duplicate=False)] if id(t) not in target_tensors]
    if foreign:
        raise NotImplementedError(
            f"{type(target).__name__}: cannot cut a self-layers draft, these tensors are not the target's after "
            f"sharing its submodules: {foreign[:5]}"
        )
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def vocabulary_size(model: PreTrainedModel) -> int:
    """V, the number of rows of the model's lm_head (the ids its logits cover)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head (get_output_embeddings() is None); use a *ForCausalLM")
    return int(head.weight.shape[0])


def check_draft_compatible(
    target: PreTrainedModel, draft: PreTrainedModel, target_tokenizer: Any = None, draft_tokenizer: Any = None
) -> None:
    """Raise ``ValueError`` unless ``draft`` proposes ids of the target's vocabulary.

    Checks that the lm_heads cover the same V ids and, when both tokenizers are given, that they map every token
    string to the same id (``get_vocab()`` equal) and agree on BOS/EOS.

    Raises:
        ValueError: the message names the field (``draft vocabulary size``, ``draft tokenizer``) and the fix.
    """
    v_target, v_draft = vocabulary_size(target), vocabulary_size(draft)
    if v_target != v_draft:
        raise ValueError(
            f"draft vocabulary size {v_draft} != target vocabulary size {v_target}: the draft must share the "
            "target's tokenizer (use a draft from the same model family, or draft=self_layers)"
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    vocab_t, vocab_d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if vocab_t != vocab_d:
        differ = sorted(set(vocab_t.items()) ^ set(vocab_d.items()))[:3]
        raise ValueError(
            f"draft tokenizer differs from the target tokenizer ({len(vocab_d)} vs {len(vocab_t)} tokens; e.g. "
            f"{differ}): speculative decoding needs one vocabulary"
        )
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(target_tokenizer, attr, None) != getattr(draft_tokenizer, attr, None):
            raise ValueError(f"draft tokenizer {attr} differs from the target's: speculative decoding needs one "
                             "vocabulary")


@dataclass
class DraftConfig:
    """The draft of speculative decoding (config group ``draft/``).

    Attributes:
        kind: ``self_layers`` (the target's first ``num_layers`` layers, shared) or ``model`` (``model``, a
            ``model/`` config of a separate model with the target's tokenizer).
        num_layers: n for ``self_layers``.
        model: the ``model/`` config for ``kind=model``.
        num_draft_tokens: K, tokens drafted per step (the first K when ``schedule=heuristic``).
        schedule: ``constant`` K, or ``heuristic``: K + 2 after a step that accepted every drafted token, else
            max(1, K - 1) (Hugging Face's ``num_assistant_tokens_schedule="heuristic"``), reset every request.
    """

    kind: str = "self_layers"
    num_layers: int = field(default=8, metadata=bound(1, cap=MAX_COUNT))
    model: Optional[Any] = None
    num_draft_tokens: int = field(default=5, metadata=bound(1, cap=MAX_COUNT, hint="K, tokens drafted per step"))
    schedule: str = "constant"

    def validate(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"draft.kind must be one of {DRAFT_KINDS}, got {self.kind!r}")
        if self.kind == "self_layers" and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f"draft.num_layers must be an int >= 1, got {self.num_layers!r}")
        if self.kind == "model" and self.model is None:
            raise ValueError("draft.kind=model needs draft.model (a model/ config, e.g. draft/model with "
                             "draft.model.name_or_path=...)")
        check_draft_length(self.num_draft_tokens, "draft.num_draft_tokens")
        check_schedule(self.schedule, "draft.schedule")
        check_bounds(self, "draft")  # the caps against typos


def check_draft_length(value: Any, field: str = "num_draft_tokens") -> int:
    """Return ``value`` if it is an int >= 1, else raise ``ValueError`` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} (K, tokens drafted per step) must be an int >= 1, got {value!r}")
    return value


def check_schedule(value: Any, field: str = "schedule") -> str:
    """Return ``value`` if it is one of :data:`SCHEDULES`, else raise ``ValueError`` naming ``field``."""
    if value not in SCHEDULES:
        raise ValueError(f"{field} must be one of {SCHEDULES}, got {value!r}")
    return value


def load_draft(cfg: Any, target: PreTrainedModel, target_tokenizer: Any = None) -> tuple[PreTrainedModel, Any]:
    """Build the draft a ``draft/`` config describes, checked against the target.

    Args:
        cfg: a :class:`DraftConfig` or an OmegaConf node / dict of its fields (validated first).
        target: the target ``*ForCausalLM``.
        target_tokenizer: the target's tokenizer, compared with a separate draft's.

    Returns:
        ``(draft, draft_tokenizer)``; the tokenizer is None for ``self_layers`` (it is the target's).

    Raises:
        ValueError: a bad field, or a draft with another vocabulary.
        FileNotFoundError: the draft's checkpoint is missing.
    """
    from medusa_train.config.schema import ModelConfig, as_dataclass
    from medusa_train.loading.base import load_base_model

    draft_cfg = as_dataclass(DraftConfig, cfg)
    if draft_cfg.kind == "self_layers":
        return self_layer_draft(target, draft_cfg.num_layers), None
    draft, tokenizer = load_base_model(as_dataclass(ModelConfig, draft_cfg.model))
    check_draft_compatible(target, draft, target_tokenizer, tokenizer)
    return draft, tokenizer


__all__ = [
    "DRAFT_KINDS",
    "DraftConfig",
    "SCHEDULES",
    "check_draft_compatible",
    "check_draft_length",
    "load_draft",
    "self_layer_draft",
    "vocabulary_size",
]
