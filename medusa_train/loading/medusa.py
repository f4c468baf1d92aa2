"""Load an export folder together with the base model it was trained for.

An export's ``config.json`` holds ``base_model_name_or_path`` (for FasterDecoding, TGI and vLLM) and, when written
by ``medusa-train``, the full ``model/`` config under :data:`EXPORT_MODEL_KEY`, so a GGUF or llama2.c base is
rebuilt exactly as it was trained on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PreTrainedTokenizerBase

from medusa_train.config import ModelConfig, as_dataclass
from medusa_train.export import load_heads
from medusa_train.loading.base import load_base_model
from medusa_train.model import MedusaModel, check_heads_match_base

EXPORT_MODEL_KEY = "medusa_train_model"


def export_extra_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """The ``extra_config`` entry that records how the base model was loaded (for :func:`model_config_for_export`)."""
    return {EXPORT_MODEL_KEY: dataclasses.asdict(model_cfg)}


def model_config_for_export(export_config: dict[str, Any], override: Any = None) -> ModelConfig:
    """The base model's config: ``override`` (a ModelConfig or mapping) when given, else the one recorded in the
    export, else ``base_model_name_or_path`` as an HF id or folder."""
    if override is not None:
        return as_dataclass(ModelConfig, override)
    recorded = export_config.get(EXPORT_MODEL_KEY)
    if recorded:
        return as_dataclass(ModelConfig, recorded)
    return as_dataclass(ModelConfig, {"name_or_path": export_config["base_model_name_or_path"]})


def load_medusa(
    export_dir: str, model: Any = None, dtype: str | None = None, device: str | None = None
) -> tuple[MedusaModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """Base model + heads from an export folder.

    Args:
        export_dir: the export folder (``config.json`` + ``medusa_lm_head.safetensors``).
        model: optional ``model/`` config overriding the base recorded in the export.
        dtype, device: optional overrides of the model config's ``dtype`` / ``device``; the heads follow.

    Returns:
        ``(MedusaModel, tokenizer, export_config)``.

    Raises:
        FileNotFoundError: no export there (checked before the base model is loaded).
        ValueError: the heads do not fit the base model (hidden size or vocabulary named).
    """
    # Heads first: a folder without heads or with a broken file fails in a second, before the base model loads.
    heads, export_config = load_heads(export_dir)
    cfg = model_config_for_export(export_config, model)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    base, tokenizer = load_base_model(cfg)
    check_heads_match_base(heads.spec, base)
    weight = base.get_output_embeddings().weight
    heads = heads.to(device=weight.device, dtype=weight.dtype).requires_grad_(False)
    return MedusaModel(base, heads.eval()), tokenizer, export_config
