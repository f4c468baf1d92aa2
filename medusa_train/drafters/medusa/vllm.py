"""Medusa heads in vLLM: vLLM's Medusa speculator (``speculative_config`` method ``medusa``) reads the export's
``vllm/`` folder, which the export writes in the ``medusa`` layout (:mod:`medusa_train.export.writer`; vLLM 0.32's
``vllm/model_executor/models/medusa.py``); the ``vllm_medusa`` decoder runs it (:data:`VLLM_DECODER`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from medusa_train.config.bounds import MAX_COUNT, bound
from medusa_train.models.catalog import EngineDecoder
from medusa_train.engines.settings import VllmSettings
from medusa_train.engines.vllm_env import SPECULATIVE_FILE, tuned_speculative_tokens
from medusa_train.export.configs import VLLM_MODEL_TYPE
from medusa_train.export.files import read_json
from medusa_train.export.writer import CONFIG_FILE, VLLM_DIR

VLLM_METHOD = "medusa"  # vLLM's speculative_config method for these heads


def speculative_config(export_dir: str | os.PathLike[str], num_speculative_tokens: int | None = None,
                       recorded: bool = True) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the heads of an export: ``{"method": "medusa", "model": <export>/vllm,
    "num_speculative_tokens": K}``. vLLM's Medusa drafts one chain of each head's top-1 token, so K is the number
    of heads (``medusa_choices.json``, a tree, is not used by vLLM).

    Args:
        export_dir: the export folder (holding ``vllm/``).
        num_speculative_tokens: 1..K drafted tokens per step (the first heads); None: the length measured fastest
            (:data:`~medusa_train.engines.vllm_env.SPECULATIVE_FILE`,
            :func:`~medusa_train.engines.vllm_env.tuned_speculative_tokens`; not with ``recorded=False``), else all K
            heads.

    Raises:
        FileNotFoundError: no ``vllm/config.json`` (re-export with ``export_vllm=true``).
        ValueError: ``vllm/config.json`` is not vLLM's Medusa, or ``num_speculative_tokens`` outside 1..K.
    """
    folder = Path(export_dir) / VLLM_DIR
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} not found: re-export the heads with export_vllm=true "
                                "(medusa-train writes vllm/ by default)")
    config = read_json(folder / CONFIG_FILE)
    if config.get("model_type") != VLLM_MODEL_TYPE or not isinstance(config.get("num_heads"), int):
        raise ValueError(f"{folder / CONFIG_FILE}: not vLLM's Medusa config (model_type "
                         f"{config.get('model_type')!r}, num_heads {config.get('num_heads')!r})")
    heads = config["num_heads"]
    k = num_speculative_tokens
    if k is None:
        k = (tuned_speculative_tokens(export_dir, VLLM_METHOD) if recorded else None) or heads
        if k > heads:  # a file hand-edited or recorded for another export
            raise ValueError(f"{Path(export_dir) / SPECULATIVE_FILE}: num_speculative_tokens={k} exceeds the export's "
                             f"{heads} heads; rerun benchmarks/serve_vllm.py --record, or set num_speculative_tokens")
    if not 1 <= k <= heads:
        raise ValueError(f"num_speculative_tokens must be in [1, {heads}] (the export has {heads} heads), got {k}")
    return {"method": VLLM_METHOD, "model": str(folder.resolve()), "num_speculative_tokens": k}


@dataclass
class VllmMedusaSettings(VllmSettings):
    """vLLM's Medusa speculator with the export's ``vllm/`` heads (:class:`~inference.decoders.vllm.VllmDecoder`):
    each head's top-1 token drafted as one chain (no tree), verified by the target in one pass. The fields of
    :class:`~medusa_train.engines.settings.VllmSettings`, and:

    Attributes:
        num_speculative_tokens: drafted tokens per step, 1..K (the first heads); None: the length measured fastest
            (the export's ``vllm_speculative.json``, ``benchmarks/serve_vllm.py --record``), else all K heads.
        method: vLLM's speculative method this decoder serves (the catalog's
            :attr:`~medusa_train.models.catalog.DrafterType.vllm_method`; its type gives the ``speculative_config``).
    """

    num_speculative_tokens: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    method: ClassVar[str] = VLLM_METHOD


VLLM_DECODER = EngineDecoder("vllm_medusa", "vllm", VllmMedusaSettings,
                             "vLLM's Medusa speculator with the export's vllm/ heads (a chain of top-1 drafts)")

__all__ = ["VLLM_DECODER", "VLLM_METHOD", "VllmMedusaSettings", "speculative_config"]
