"""The config.json files of an export: ours (FasterDecoding's fields plus sizes) and vLLM's ``MedusaConfig``, or a
Hydra export's own.

Ours keeps FasterDecoding's ``MedusaConfig`` names (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``) so FasterDecoding and Text Generation Inference read the folder as one of theirs; TGI
takes a config with ``medusa_num_heads`` as a Medusa speculator, and one with ``architectures`` as something else,
so that key is never written there.

vLLM's (``vllm/transformers_utils/configs/medusa.py``, vLLM 0.32): ``model_type "medusa"``, ``architectures
["MedusaModel"]``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers``, ``max_paths``, ``topk``,
``truncated_vocab_size``, plus attributes its model reads: ``original_lm_head`` (one lm_head for every head) and
``medusa_fc_bias`` (biases in the residual blocks; False when absent). vLLM 0.32 cannot load a ``token_map``
(``writer.py`` explains), so ``truncated_vocab_size`` is always V and a reduced head vocabulary is recorded for our
own reader only: ``medusa_train_head_vocab_size`` here and the ``medusa_train.token_map`` tensor (vLLM ignores both).

Drafter types with the ``state_dict`` layout (:mod:`medusa_train.models.catalog`; Hydra heads) have no engine
layout here. Their config.json says ``head_type`` and names the spec's own fields by the type's ``config_keys``
(``hydra_num_heads`` / ``hydra_num_layers`` / ``hydra_combine``), never ``medusa_num_heads``, so that FasterDecoding's
and TGI's Medusa loaders do not take the folder for theirs; a reader checks each such key's JSON type against the
spec field it records (:func:`field_types`), whatever the type. A config.json without ``head_type`` holds Medusa heads
(every export written before Hydra heads existed).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import torch

from medusa_train.version import __version__
from medusa_train.export.layouts import FASTERDECODING
from medusa_train.models.catalog import MEDUSA_LAYOUT, DrafterType, drafter_types, type_of
from medusa_train.models.heads_base import HeadsSpec

# vllm/: vLLM's MedusaConfig (the name of vLLM's format, not of a drafter type), and the reduced head vocabulary of
# heads written with full-vocabulary projections (ignored by vLLM).
VLLM_MODEL_TYPE = "medusa"
VLLM_HEAD_VOCAB_KEY = "medusa_train_head_vocab_size"
VLLM_TOKEN_MAP = "medusa_train.token_map"

EXPORT_VERSION = 1  # bump when the export layout changes incompatibly; readers refuse newer versions
HEAD_TYPE_KEY = "head_type"  # absent: Medusa heads
# {path relative to the export: hex sha256} of the files a type's engine writer wrote (EAGLE-3: speculators/), which
# engines read themselves: checked before they are served or converted (drafters/eagle3/speculators.py)
ENGINE_SHA256_KEY = "engine_files_sha256"

# Keys save_export writes itself; extra_config may not override them.
_OWN_KEYS = ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size", "base_model_name_or_path",
             "share_lm_head", "version", "head_vocab_size", "torch_dtype", "medusa_train_version",
             "base_model_class", "base_model_type", HEAD_TYPE_KEY, ENGINE_SHA256_KEY)
# The sizes every drafter type's config.json records under these names (DrafterType.config_keys adds its own).
_COMMON_FIELDS = {"hidden_size": int, "vocab_size": int, "share_lm_head": bool}


def export_head_type(config: dict[str, Any]) -> Any:
    """The head type an export's ``config.json`` records: its ``head_type``, ``"medusa"`` when absent (every export
    written before Hydra heads, and every Medusa export: FasterDecoding's layout has no such key). Not checked here
    (see :func:`medusa_train.head_types.check_head_type`)."""
    return config.get(HEAD_TYPE_KEY, "medusa")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_config(
    spec: HeadsSpec,
    base_model_name_or_path: str,
    dtype: torch.dtype,
    base_model_class: str | None = None,
    base_model_type: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Our ``config.json``: the heads' own fields under their type's names
    (:attr:`~medusa_train.models.catalog.DrafterType.config_keys`; Medusa: FasterDecoding's ``medusa_num_heads``,
    ``medusa_num_layers``), ``head_type`` for every type but Medusa (FasterDecoding's layout has no such key), then the
    sizes and provenance.

    Raises:
        ValueError: ``extra_config`` sets a key written from the heads, or ``architectures`` (TGI would then not
            take the folder for a Medusa speculator).
    """
    entry = type_of(spec)
    config: dict[str, Any] = {} if entry.layout == MEDUSA_LAYOUT else {HEAD_TYPE_KEY: entry.name}
    config.update(entry.config_fields(spec))
    config.update({
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "base_model_name_or_path": base_model_name_or_path,
        "share_lm_head": spec.share_lm_head,
        "version": EXPORT_VERSION,
    })
    if spec.head_vocab_size is not None:
        config["head_vocab_size"] = spec.head_vocab_size
    config["torch_dtype"] = dtype_name(dtype)
    config["medusa_train_version"] = __version__
    if base_model_class is not None:
        config["base_model_class"] = base_model_class
    if base_model_type is not None:
        config["base_model_type"] = base_model_type
    extra = dict(extra_config or {})
    clashes = sorted(set(extra) & {*_OWN_KEYS, *entry.config_keys.values()})
    if clashes:
        raise ValueError(f"extra_config may not set {clashes}: they are written from the heads themselves")
    if "architectures" in extra:
        raise ValueError("extra_config may not set 'architectures': Text Generation Inference would then not read "
                         "the export as Medusa heads")
    config.update(extra)
    return config


def vllm_config(spec: HeadsSpec, dtype: torch.dtype) -> dict[str, Any]:
    """``vllm/config.json`` for vLLM's ``MedusaConfig``: projections over all V tokens (see ``writer.py``).

    vLLM renames every key holding ``num`` and ``heads`` to ``num_heads`` (``layers``: ``num_hidden_layers``) in
    ``MedusaConfig.from_pretrained``, so no other such key may appear here.
    """
    config = {
        "model_type": VLLM_MODEL_TYPE,
        "architectures": ["MedusaModel"],
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "num_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "max_paths": 64,
        "topk": 10,
        "truncated_vocab_size": spec.vocab_size,
        "original_lm_head": spec.share_lm_head,
        "medusa_fc_bias": True,
        "torch_dtype": dtype_name(dtype),
    }
    if spec.head_vocab_size is not None:
        config[VLLM_HEAD_VOCAB_KEY] = spec.head_vocab_size
    return config


# config.json fields every reader of ours relies on, and their JSON types (checked when present; bool is not an int).
# A drafter type's own keys (DrafterType.config_keys) are checked against its spec's field types (json_kinds).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "hidden_size": (int,), "vocab_size": (int,),
    "head_vocab_size": (int, type(None)), "version": (int,), "share_lm_head": (bool,),
    "base_model_name_or_path": (str,), "original_base_model_name_or_path": (str,), "torch_dtype": (str,),
    "medusa_train_version": (str,), "base_model_class": (str,), "base_model_type": (str,), HEAD_TYPE_KEY: (str,),
    "medusa_train_model": (dict,),
}
_JSON_TYPE = {int: "an integer", bool: "true or false", str: "a string", dict: "an object", type(None): "null",
              float: "a number", list: "a list"}


def json_kinds(annotation: Any) -> tuple[type, ...] | None:
    """The JSON value types (as Python types ``json`` reads them) a spec field of type ``annotation`` is written as:
    ``int`` -> ``(int,)``, ``float`` -> ``(int, float)``, ``tuple[int, ...]`` or ``list`` -> ``(list,)``,
    ``Optional[X]`` adds ``NoneType``; None for a type that is not checked."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [json_kinds(a) for a in args]
        return None if any(p is None for p in parts) else tuple(k for p in parts for k in p)
    if annotation is type(None):
        return (type(None),)
    if annotation is float:
        return (int, float)
    if annotation in (int, bool, str, dict):
        return (annotation,)
    if annotation in (tuple, list) or origin in (tuple, list):
        return (list,)
    return None


def field_types() -> dict[str, tuple[type, ...]]:
    """Every ``config.json`` key whose type a reader checks: the shared ones and each registered type's own."""
    own = {key: kinds for entry in drafter_types() for key, annotation in entry.config_types().items()
           if (kinds := json_kinds(annotation)) is not None}
    return {**_FIELD_TYPES, **own}


def check_field_types(config: dict[str, Any], source: str) -> None:
    """Check the types of the fields of our (and FasterDecoding's) ``config.json`` that are present.

    Raises:
        ValueError: ``{source}/config.json: {field} must be ..., got ...`` for the first wrong one.
    """
    for key, kinds in field_types().items():
        if key not in config:
            continue
        value = config[key]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            want = " or ".join(_JSON_TYPE[k] for k in kinds)
            raise ValueError(f"{source}/config.json: {key} must be {want}, got {value!r}; re-export the heads or "
                             "correct the field")


def check_version(config: dict[str, Any], source: str) -> None:
    """Raise ``ValueError`` for an export written by a newer, incompatible medusa-train."""
    version = config.get("version")
    if isinstance(version, int) and version > EXPORT_VERSION:
        raise ValueError(f"{source}: export format version {version} is newer than this medusa-train reads "
                         f"({EXPORT_VERSION}); upgrade medusa-train")


def spec_from_medusa_config(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], base_hv: tuple[int, int] | None, source: str
) -> HeadsSpec:
    """:class:`HeadsSpec` from our config or FasterDecoding's, filling what FasterDecoding's lacks.

    FasterDecoding's ``config.json`` may lack ``medusa_num_layers`` (inferred from the ``{h}.{l}.linear.weight``
    keys), ``hidden_size`` (from those weights) and ``vocab_size`` (from the projection, else the base model).

    Args:
        config: the parsed ``config.json``.
        shapes: key -> shape of the weights file (FasterDecoding names).
        base_hv: (H, V) of the base model when one was given.
        source: the folder, for messages.

    Raises:
        ValueError: a required field is missing or of the wrong type and cannot be inferred.
    """
    if "medusa_num_heads" not in config:
        raise ValueError(f"{source}/config.json has no medusa_num_heads: is this a Medusa heads folder?")
    share = config.get("share_lm_head", False)
    if not isinstance(share, bool):
        raise ValueError(f"{source}/config.json: share_lm_head must be true or false, got {share!r}")
    layer_keys = [m for k in shapes if (m := re.fullmatch(r"0\.(\d+)\.linear\.weight", k))]
    num_layers = config.get("medusa_num_layers")
    if num_layers is None:
        if not layer_keys:
            raise ValueError(f"{source}: config.json has no medusa_num_layers and the weights have no "
                             "'0.{l}.linear.weight' keys to infer it from")
        num_layers = 1 + max(int(m.group(1)) for m in layer_keys)
    hidden_size = config.get("hidden_size")
    if hidden_size is None:
        if layer_keys:
            hidden_size = shapes[layer_keys[0].group(0)][-1]
        elif base_hv is not None:
            hidden_size = base_hv[0]
        else:
            raise ValueError(f"{source}: config.json has no hidden_size and no weight to infer it from")
    vocab_size = config.get("vocab_size")
    head_vocab_size = config.get("head_vocab_size")
    if head_vocab_size is not None and not isinstance(head_vocab_size, int):
        raise ValueError(f"{source}/config.json: head_vocab_size must be an integer, got {head_vocab_size!r}")
    if vocab_size is None:
        projection = FASTERDECODING.projection.format(h=0, L=num_layers)
        if head_vocab_size is None and not share and projection in shapes:
            vocab_size = shapes[projection][0]
        elif base_hv is not None:
            vocab_size = base_hv[1]
        else:
            raise ValueError(f"{source}: config.json has no vocab_size; add it or pass the base model")
    try:
        return HeadsSpec(num_heads=config["medusa_num_heads"], num_layers=num_layers, hidden_size=hidden_size,
                         vocab_size=vocab_size, share_lm_head=share, head_vocab_size=head_vocab_size)
    except ValueError as e:
        raise ValueError(f"{source}/config.json: {e}") from e


def spec_from_config(entry: DrafterType, config: dict[str, Any], source: str) -> Any:
    """The spec of a ``state_dict``-layout export of type ``entry`` (Hydra heads, ...) from its ``config.json``: the
    type's own fields (:attr:`~medusa_train.models.catalog.DrafterType.config_keys`) and the common sizes.

    Raises:
        ValueError: a field missing or of the wrong type (named), or an invalid value.
    """
    kinds = {key: json_kinds(annotation) or (object,) for key, annotation in entry.config_types().items()}
    fields = {**kinds, **{key: (kind,) for key, kind in _COMMON_FIELDS.items()}}
    missing = [k for k in fields if k not in config]
    if missing:
        raise ValueError(f"{source}/config.json (head_type {entry.name}) is missing {missing}")
    wrong = [f"{k}={config[k]!r}" for k, kind in fields.items()
             if kind != (object,) and (not isinstance(config[k], kind)
                                       or (bool not in kind and isinstance(config[k], bool)))]
    head_vocab_size = config.get("head_vocab_size")
    if head_vocab_size is not None and not isinstance(head_vocab_size, int):
        wrong.append(f"head_vocab_size={head_vocab_size!r}")
    if wrong:
        raise ValueError(f"{source}/config.json: wrong types for {', '.join(wrong)}")
    values = {name: config[key] for name, key in entry.config_keys.items()}
    try:
        return entry.spec_cls(**values, hidden_size=config["hidden_size"], vocab_size=config["vocab_size"],
                              share_lm_head=config["share_lm_head"], head_vocab_size=head_vocab_size)
    except ValueError as e:
        raise ValueError(f"{source}/config.json: {e}") from e


def read_vllm_config(raw: dict[str, Any], source: str) -> tuple[HeadsSpec, bool]:
    """(:class:`HeadsSpec`, ``medusa_fc_bias``) from a vLLM Medusa ``config.json``, read by vLLM's rules.

    Applies ``MedusaConfig.from_pretrained``'s renaming (keys with ``num`` + ``heads`` -> ``num_heads``, ``num`` +
    ``layers`` -> ``num_hidden_layers``) and its defaults for ``num_hidden_layers`` (1) and ``truncated_vocab_size``
    (``vocab_size``); ``original_lm_head`` maps to ``share_lm_head``. ``hidden_size``, ``vocab_size`` and
    ``num_heads`` are required here (vLLM would silently use Vicuna-7B's sizes). A reduced head vocabulary is
    ``truncated_vocab_size < vocab_size`` (a ``token_map`` tensor, older vLLM versions) or our
    ``medusa_train_head_vocab_size`` (full-vocabulary projections plus ``medusa_train.token_map``).

    Raises:
        ValueError: ``model_type`` is not ``medusa`` or a required field is missing.
    """
    config = dict(raw)
    for key in list(config):
        if "num" in key and "heads" in key:
            config["num_heads"] = config.pop(key)
        elif "num" in key and "layers" in key:
            config["num_hidden_layers"] = config.pop(key)
    if config.get("model_type") != VLLM_MODEL_TYPE:
        raise ValueError(f"{source}/config.json: model_type must be {VLLM_MODEL_TYPE!r} for vLLM, "
                         f"got {config.get('model_type')!r}")
    missing = [k for k in ("hidden_size", "vocab_size", "num_heads") if k not in config]
    if missing:
        raise ValueError(f"{source}/config.json is missing {missing}")
    vocab_size = config["vocab_size"]
    truncated = config.get("truncated_vocab_size")
    truncated = vocab_size if truncated is None else truncated
    if truncated == vocab_size and config.get(VLLM_HEAD_VOCAB_KEY) is not None:
        truncated = config[VLLM_HEAD_VOCAB_KEY]
    spec = HeadsSpec(
        num_heads=config["num_heads"],
        num_layers=config.get("num_hidden_layers", 1),
        hidden_size=config["hidden_size"],
        vocab_size=vocab_size,
        share_lm_head=bool(config.get("original_lm_head", False)),
        head_vocab_size=truncated if truncated != vocab_size else None,
    )
    return spec, bool(config.get("medusa_fc_bias", False))
