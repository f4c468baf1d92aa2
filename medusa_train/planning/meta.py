"""The target model and the drafter built on PyTorch's ``meta`` device: shapes without storage, so a 70B model
"builds" in about two seconds on a laptop and nothing is downloaded or allocated.

:func:`target_sizes` reads what the memory plan needs of the target (exact parameter counts of the whole model, its
largest decoder layer, embeddings, lm_head, and the attention shape the KV cache follows); :func:`heads_sizes` builds
the drafter of ``heads.*`` through the project's own classes (:mod:`medusa_train.models.catalog`) on ``meta`` and
counts its parameters. Counts are ``numel`` sums, exact; bytes follow from a dtype chosen by the caller (a meta
tensor's own dtype is whatever the config said, not what the run loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TargetSizes:
    """What the plan needs of the target model (parameter counts exact, from the meta model).

    Attributes:
        params: all parameters (tied weights counted once).
        largest_layer: the largest decoder layer's parameters (what ZeRO-3 gathers at once in a forward pass).
        embed: the input embeddings ``[V, H]``.
        lm_head: the output projection ``[V, H]`` (0 when tied to the embeddings: already in ``embed``).
        num_layers, hidden_size, vocab_size, intermediate_size: L, H, V, the MLP width.
        num_attention_heads, num_kv_heads, head_dim: the attention's shape (the KV cache's per layer:
            ``2 x num_kv_heads x head_dim`` values per token).
        linear_widths: per decoder layer, the sum over its linear maps of ``in + out`` features (the activations a
            forward with gradient saves per token and layer: each map's input and output).
        lora_widths: per decoder layer, ``name -> in + out`` of each linear map (LoRA's ``r x (in + out)`` params).
        dtype_name: the dtype the config names (``torch_dtype``), e.g. ``bfloat16``.
    """

    params: int
    largest_layer: int
    embed: int
    lm_head: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_widths: int
    lora_widths: dict[str, int]
    dtype_name: str

    @property
    def largest_gathered(self) -> int:
        """The largest block ZeRO-3 gathers whole: a decoder layer, the embeddings or the lm_head."""
        return max(self.largest_layer, self.embed, self.lm_head)


# The size fields a plan reads of the target's config (under the config class's own names where it maps them, e.g.
# GPT-2's n_embd). transformers fills a missing one with its class's default (LlamaConfig: hidden_size 4,096,
# intermediate_size 11,008), which plans another model: a 70B without them was planned as 17.9B and said to fit.
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
CONTEXT_FIELD = "max_position_embeddings"


def _stored(config: Any, raw: dict[str, Any], name: str) -> Any:
    """The value of field ``name`` of ``config`` (its text config's) as the file stores it, or None when absent."""
    text = getattr(config, "get_text_config", lambda: config)()
    section = raw.get("text_config", raw) if text is not config and isinstance(raw.get("text_config"), dict) else raw
    key = text.attribute_map.get(name, name)
    return section.get(key, section.get(name))


def check_size_fields(config: Any, raw: dict[str, Any], source: str) -> None:
    """Refuse a config whose file lacks a :data:`SIZE_FIELDS` entry its class has (a class without the field, as
    GPT-2 has no ``intermediate_size``, is not asked for it).

    Args:
        config: the ``PretrainedConfig`` transformers made of the file.
        raw: the file's JSON as stored (``PretrainedConfig.get_config_dict``).
        source: what to name (the path, or the setting that gave it).

    Raises:
        ValueError: the missing fields named, with the default transformers would have put in each and the fix.
    """
    text = getattr(config, "get_text_config", lambda: config)()
    missing = [n for n in SIZE_FIELDS if hasattr(text, n) and _stored(config, raw, n) is None]
    if missing:
        guessed = ", ".join(f"{n}={getattr(text, n)}" for n in missing)
        raise ValueError(f"{source} has no {', '.join(missing)}: transformers would put {type(text).__name__}'s "
                         f"defaults there ({guessed}) and plan another model; give the model's own config.json, or "
                         f"add {', '.join(missing)} to it")


def stored_context(config: Any, raw: dict[str, Any]) -> int | None:
    """The context length (``max_position_embeddings``) the file states, or None when it states none (then nothing
    is checked against it: the class's default is not the model's)."""
    value = _stored(config, raw, CONTEXT_FIELD)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def raw_config(name_or_path: str | Path, **kwargs: Any) -> dict[str, Any]:
    """The JSON of a model's ``config.json`` as stored (a file, a folder or a cached Hub id; local files only)."""
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(str(name_or_path), local_files_only=True, **kwargs)[0]


def load_target_config(path: str | Path) -> Any:
    """The transformers ``PretrainedConfig`` of a ``config.json`` file or a local model folder (no network; never a
    Hub id), checked to state its sizes (:func:`check_size_fields`).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: nothing readable there, or sizes missing (the path named).
    """
    from transformers import AutoConfig

    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such file or folder (give the target's config.json or a local model "
                                "folder holding one)")
    try:
        config, raw = AutoConfig.from_pretrained(str(path), local_files_only=True), raw_config(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read a model config at {path}: {e}") from e
    check_size_fields(config, raw, str(path))
    return config


def meta_target(config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the ``meta`` device (no weights, no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def count(module: nn.Module) -> int:
    """Parameters of ``module`` (tied weights once)."""
    return sum(p.numel() for p in module.parameters())


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The longest ``ModuleList`` of the model: its decoder layers."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to plan for")
    return max(lists, key=len)


_MEASURED: dict[str, TargetSizes] = {}  # config JSON -> its sizes (a plan and its fixes build the target once)


def target_sizes(config: Any) -> TargetSizes:
    """:class:`TargetSizes` of the target ``config`` (built on meta: :func:`meta_target`; remembered per config)."""
    key = config.to_json_string()
    if key not in _MEASURED:
        _MEASURED[key] = _measure(config)
    return _MEASURED[key]


def _measure(config: Any) -> TargetSizes:
    model = meta_target(config)
    text = getattr(config, "get_text_config", lambda: config)()
    layers = _decoder_layers(model)
    embed_w = model.get_input_embeddings().weight
    head_w = model.get_output_embeddings().weight
    first = layers[0]
    lora = {name.rsplit(".", 1)[-1]: m.in_features + m.out_features for name, m in first.named_modules()
            if isinstance(m, nn.Linear)}
    heads = int(text.num_attention_heads)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return TargetSizes(
        params=count(model), largest_layer=max(count(layer) for layer in layers), embed=embed_w.numel(),
        lm_head=0 if head_w is embed_w else head_w.numel(), num_layers=len(layers),
        hidden_size=int(text.hidden_size), vocab_size=int(head_w.shape[0]),
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
        num_attention_heads=heads, num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        linear_widths=sum(lora.values()), lora_widths=lora,
        dtype_name=str(dtype).removeprefix("torch."),
    )


@dataclass(frozen=True)
class HeadsSizes:
    """What the plan needs of the drafter (exact counts, from the meta drafter).

    Attributes:
        head_type: its type (``medusa``, ``hydra``, ``eagle3``).
        params: trainable parameters.
        largest_param: the largest single parameter (ZeRO-3 gathers a parameter whole; Medusa's stacked
            ``lm_head_weight [K, V', H]`` is one).
        out_size: V', the logits each head (step) produces.
        linear_widths: sum over its weight matrices, projections onto V' left out, of ``(in + out) x`` the number
            of maps stacked in the matrix (Medusa's ``block_weight [K, L, H, H]`` is K x L maps): the activations
            one pass saves per token.
        passes: how often one training step runs those maps per token (an EAGLE-3 drafter's K unrolled steps; 1
            for heads that read the target's features once).
        features: the target features it reads (:mod:`medusa_train.models.features` names).
        reads_path: it reads the base's input embeddings of the path tokens.
        num_heads: K.
    """

    head_type: str
    params: int
    largest_param: int
    out_size: int
    linear_widths: int
    passes: int
    features: tuple[str, ...]
    reads_path: bool
    num_heads: int


def meta_heads(heads_cfg: Any, target_config: Any, sizes: TargetSizes) -> tuple[nn.Module, Any]:
    """The drafter ``heads_cfg`` (``heads.*``, :class:`~medusa_train.config.schema.HeadShape`) describes for the target,
    built on meta through its registered class; returns ``(module, spec)``.

    Raises:
        ValueError: settings the drafter refuses (from its spec, naming the field).
    """
    from medusa_train.models.catalog import heads_from_spec, spec_for_config

    spec = spec_for_config(heads_cfg, target_config, sizes.hidden_size, sizes.vocab_size)
    with torch.device("meta"):
        token_map = None if spec.head_vocab_size is None else torch.zeros(spec.head_vocab_size, dtype=torch.long)
        return heads_from_spec(spec, token_map), spec


def heads_sizes(heads_cfg: Any, target_config: Any, sizes: TargetSizes) -> HeadsSizes:
    """:class:`HeadsSizes` of the drafter of ``heads_cfg`` (see :func:`meta_heads`)."""
    from medusa_train.models.catalog import type_of

    module, spec = meta_heads(heads_cfg, target_config, sizes)
    entry = type_of(spec)
    widths = 0
    for name, p in module.named_parameters():
        # a weight matrix [..., out, in] (biases and norms left out), not a projection onto V'
        if name.endswith("weight") and p.ndim >= 2 and p.shape[-2] != spec.out_size:
            widths += (p.shape[-1] + p.shape[-2]) * (p.numel() // (p.shape[-1] * p.shape[-2]))
    return HeadsSizes(head_type=entry.name, params=count(module), largest_param=max(p.numel() for p in
                                                                                    module.parameters()),
                      out_size=spec.out_size, linear_widths=widths, passes=spec.num_heads if entry.sequence else 1,
                      features=entry.feature_names(spec), reads_path=entry.reads_path, num_heads=spec.num_heads)


__all__ = ["CONTEXT_FIELD", "HeadsSizes", "SIZE_FIELDS", "TargetSizes", "check_size_fields", "count", "heads_sizes",
           "load_target_config", "meta_heads", "meta_target", "raw_config", "stored_context", "target_sizes"]
