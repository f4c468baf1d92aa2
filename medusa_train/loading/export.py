"""Load an export folder together with the base model it was trained for.

An export's ``config.json`` holds ``base_model_name_or_path`` (for FasterDecoding, TGI and vLLM) and, when written
by ``medusa-train``, the full ``model/`` config under :data:`EXPORT_MODEL_KEY`, so a GGUF or llama2.c base is
rebuilt exactly as it was trained on. A Medusa-2 export carries its fine-tuned base inside (``export/base``) and
records it by a path relative to the export folder, so the folder can be moved or copied whole:
:func:`resolve_export_base` turns such a path into the folder's.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import os
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from transformers import PreTrainedTokenizerBase

from medusa_train.config.schema import ModelConfig, as_dataclass
from medusa_train.export import load_heads
from medusa_train.loading.base import load_base_model
from medusa_train.models.speculative import SpeculativeModel, check_heads_match_base

log = logging.getLogger(__name__)

EXPORT_MODEL_KEY = "medusa_train_model"


def export_extra_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """The ``extra_config`` entry that records how the base model was loaded (for :func:`model_config_for_export`)."""
    return {EXPORT_MODEL_KEY: dataclasses.asdict(model_cfg)}


def _is_partial(override: Any) -> bool:
    """Whether a ``model`` override only changes settings of the recorded base (a mapping without
    ``name_or_path``, e.g. ``+model.trust_remote_code=true``) rather than naming a base of its own."""
    if isinstance(override, ModelConfig):
        return False
    if OmegaConf.is_config(override):
        override = OmegaConf.to_container(override)
    return isinstance(override, dict) and override.get("name_or_path") in (None, MISSING)


def _as_model_config(values: Any, source: str, field: str) -> ModelConfig:
    try:
        return as_dataclass(ModelConfig, values)
    except ValueError as e:
        raise ValueError(f"{source}: {field}: {e}") from e
    except Exception as e:  # OmegaConf's errors for unknown keys and wrong types
        raise ValueError(f"{source}: {field} is not a model/ config ({type(e).__name__}: {e}); re-export the heads "
                         "or choose the base on the command line with model=<model config>") from e


def _recorded_model(export_config: dict[str, Any], source: str) -> dict[str, Any]:
    """The base model the export records, as ``model/`` settings, with ``trust_remote_code`` dropped.

    The file may come from anyone (a download): remote code runs only when the user asks for it, never because the
    export says so (transformers' own rule).
    """
    recorded = export_config.get(EXPORT_MODEL_KEY)
    if recorded:
        if not isinstance(recorded, dict):
            raise ValueError(f"{source}: {EXPORT_MODEL_KEY} must be an object (a model/ config), got "
                             f"{type(recorded).__name__}")
        settings = dict(recorded)
    else:
        name = export_config.get("base_model_name_or_path")
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{source} has no base_model_name_or_path (got {name!r}): it names the base model the heads were "
                "trained for, and FasterDecoding and TGI load the base from it too. Add \"base_model_name_or_path\": "
                f"\"<Hub id or local folder of the base model>\" to {source}, or choose the base on the command line "
                "with model=<model config> (e.g. model=smollm2_135m)")
        settings = {"name_or_path": name}
    if settings.pop("trust_remote_code", False):
        warnings.warn(f"{source} records trust_remote_code=true for its base model: ignored, since remote code runs "
                      "only when you ask for it (+model.trust_remote_code=true on the command line, "
                      "trust_remote_code=True in Python)", RuntimeWarning, stacklevel=2)
    return settings


def model_config_for_export(export_config: dict[str, Any], override: Any = None,
                            source: str = "the export's config.json") -> ModelConfig:
    """The base model's config: ``override`` (a ModelConfig or mapping) when it names a base, else the one recorded
    in the export (its ``model/`` config, else ``base_model_name_or_path`` as an HF id or folder) with the settings
    of an ``override`` without ``name_or_path`` applied on top (``+model.trust_remote_code=true``).

    ``trust_remote_code`` comes from the override only: a recorded ``trust_remote_code: true`` is ignored (with a
    warning), so a downloaded export never runs code on this machine unless the user asks.

    Raises:
        ValueError: none names a base model, or the recorded ``model/`` config is not one (``source``, the field
            and the fix named).
    """
    if override is not None and not _is_partial(override):
        return as_dataclass(ModelConfig, override)
    settings = _recorded_model(export_config, source)
    if override is not None:
        extra = OmegaConf.to_container(override) if OmegaConf.is_config(override) else dict(override)
        settings.update({k: v for k, v in extra.items() if k != "name_or_path"})
        return _as_model_config(settings, source, "the recorded base model with the model= settings")
    field = EXPORT_MODEL_KEY if export_config.get(EXPORT_MODEL_KEY) else "base_model_name_or_path"
    return _as_model_config(settings, source, field)


def export_base_config(export_dir: str | os.PathLike[str], export_config: dict[str, Any], model: Any = None,
                       dtype: str | None = None, device: str | None = None,
                       trust_remote_code: bool = False) -> ModelConfig:
    """The base model config :func:`load_export` loads for ``export_dir``: ``model`` or the export's recorded base
    (a Medusa-2 base inside the folder made absolute), with the ``dtype`` / ``device`` overrides applied, and
    ``trust_remote_code`` when the caller asks for it (never from the export's file).

    Raises:
        ValueError: as :func:`model_config_for_export`.
    """
    cfg = model_config_for_export(export_config, model, f"{Path(export_dir) / 'config.json'}")
    if model is None or _is_partial(model):
        cfg = resolve_export_base(export_dir, cfg)  # a Medusa-2 export's fine-tuned base, inside the folder
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    if trust_remote_code:
        cfg = dataclasses.replace(cfg, trust_remote_code=True)
    return cfg


ORIGINAL_BASE_KEY = "original_base_model_name_or_path"


def resolve_export_base(export_dir: str | os.PathLike[str], cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with a relative ``name_or_path`` that names a model folder inside ``export_dir`` made absolute.

    Other names (Hub ids, absolute paths, paths relative to the working folder) are returned unchanged.
    """
    path = Path(cfg.name_or_path)
    inside = Path(export_dir) / path
    if not path.is_absolute() and (inside / "config.json").is_file():
        return dataclasses.replace(cfg, name_or_path=str(inside.resolve()))
    return cfg


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def check_export_base(export_dir: str | os.PathLike[str], model_cfg: ModelConfig, field: str) -> dict[str, Any]:
    """Check, from its config.json alone, that the heads in ``export_dir`` were trained for ``model_cfg``'s base.

    The export's base is its recorded ``model/`` config (or ``base_model_name_or_path``), resolved against the
    export folder; a Medusa-2 export also matches the original base it was fine-tuned from.

    Returns:
        The export's config.json.

    Raises:
        FileNotFoundError: no export there (``field`` named).
        ValueError: the export was made for another base model (both names and ``field`` given).
    """
    from medusa_train.export import read_export_config

    try:
        config = read_export_config(export_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{field}={export_dir}: {e}") from e
    recorded = export_base_config(export_dir, config).name_or_path
    names = [recorded, str(config.get(ORIGINAL_BASE_KEY) or "")]
    if not any(name and _same_model(name, model_cfg.name_or_path) for name in names):
        raise ValueError(
            f"{field}={export_dir} holds heads trained for base model {recorded!r}, but model.name_or_path is "
            f"{model_cfg.name_or_path!r}: heads only fit the base they were trained on; use an export of this base "
            f"or set model.name_or_path={recorded}"
        )
    return config


def load_export(
    export_dir: str, model: Any = None, dtype: str | None = None, device: str | None = None,
    head_type: str | None = None, trust_remote_code: bool = False,
) -> tuple[SpeculativeModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """Base model + heads (Medusa or Hydra) from an export folder.

    Args:
        export_dir: the export folder (``config.json`` + ``medusa_lm_head.safetensors``, or Hydra's
            ``hydra_heads.safetensors``); a recorded base path relative to it (Medusa-2's ``base``) is found inside it.
        model: optional ``model/`` config overriding the base recorded in the export (a mapping without
            ``name_or_path`` changes settings of the recorded one).
        dtype, device: optional overrides of the model config's ``dtype`` (``auto`` included) / ``device``; the
            heads follow.
        head_type: ``medusa`` or ``hydra`` to refuse heads of the other type (None: either).
        trust_remote_code: run the base model's own Python code (``auto_map``) if it has some; only the caller (or
            ``model``) turns it on, never the export's config.json.

    Returns:
        ``(SpeculativeModel, tokenizer, export_config)``.

    Raises:
        FileNotFoundError: no export there (checked before the base model is loaded).
        ValueError: a file of the export is malformed (:func:`~medusa_train.export.load_heads`, checked before the
            base model loads), config.json names no base model (and ``model`` is None), the heads do not fit the
            base model
            (hidden size or vocabulary named), or are not of ``head_type`` (both types named).
    """
    # Heads first: a folder without heads or with a broken file fails in a second, before the base model loads.
    heads, export_config = load_heads(export_dir, head_type=head_type)
    base, tokenizer = load_base_model(export_base_config(export_dir, export_config, model, dtype, device,
                                                         trust_remote_code))
    check_heads_match_base(heads.spec, base)
    weight = base.get_output_embeddings().weight
    heads = heads.to(device=weight.device, dtype=weight.dtype).requires_grad_(False)
    return SpeculativeModel(base, heads.eval()), tokenizer, export_config
