"""EAGLE-3 drafters in vLLM: vLLM's EAGLE-3 speculator (``speculative_config`` method ``eagle3``) reads the export's
``speculators/`` folder (:mod:`~medusa_train.drafters.eagle3.speculators`, the type's engine writer for vLLM); the
``vllm_eagle3`` decoder runs it (:data:`VLLM_DECODER`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from medusa_train.models.catalog import EngineDecoder, drafter_type
from medusa_train.drafters.eagle3.speculators import (
    CONFIG_FILE,
    SPECULATORS_DIR,
    SPECULATORS_MODEL_TYPE,
    check_served_files,
)
from medusa_train.config.bounds import MAX_COUNT, bound
from medusa_train.engines.settings import VllmSettings
from medusa_train.engines.vllm_env import tuned_speculative_tokens
from medusa_train.export.configs import export_head_type
from medusa_train.export.files import read_json
from medusa_train.export.reader import read_export_config

VLLM_METHOD = "eagle3"  # vLLM's speculative_config method for these drafters


def speculative_config(export_dir: str | os.PathLike[str], num_speculative_tokens: int | None = None,
                       recorded: bool = True) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for an EAGLE-3 export: ``{"method": "eagle3", "model": <export>/speculators,
    "num_speculative_tokens": K}`` (:mod:`~medusa_train.drafters.eagle3.speculators` writes that folder). vLLM drafts
    K tokens as one chain, each step feeding the drafter its own output feature, so any K >= 1 works.

    Args:
        export_dir: the export folder (its ``config.json`` and ``speculators/``).
        num_speculative_tokens: drafted tokens per step; None: the length measured fastest
            (:data:`~medusa_train.engines.vllm_env.SPECULATIVE_FILE`,
            :func:`~medusa_train.engines.vllm_env.tuned_speculative_tokens`; not with ``recorded=False``), else the
            export's ``speculative_tokens`` (the drafter's training-time-test steps).

    Raises:
        FileNotFoundError: no export ``config.json``, or no ``speculators/config.json`` (re-export with
            ``export_vllm=true``).
        ValueError: the export's ``head_type`` is a drafter vLLM does not serve as ``eagle3`` (Medusa heads: use the
            ``vllm_medusa`` decoder), ``speculators/config.json`` is not an EAGLE-3 speculators config,
            ``speculators/`` is not what the export wrote for its drafter (tensors, other weights files, sha256:
            :func:`~medusa_train.drafters.eagle3.speculators.check_served_files`, the file named), or
            ``num_speculative_tokens`` < 1. All before vLLM starts.
    """
    head_type = export_head_type(read_export_config(export_dir))
    entry = drafter_type(head_type, f"{Path(export_dir) / CONFIG_FILE}")
    if entry.vllm_method != VLLM_METHOD:
        raise ValueError(f"{Path(export_dir) / CONFIG_FILE}: head_type {head_type!r} ({entry.title} heads) is not a "
                         "drafter vLLM serves as method eagle3 (it serves EAGLE-3 drafters, head_type 'eagle3', from "
                         "speculators/); decode Medusa heads with the vllm_medusa decoder, or pass an EAGLE-3 export")
    folder = Path(export_dir) / SPECULATORS_DIR
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} not found: re-export the drafter with export_vllm=true "
                                "(it writes speculators/, what vLLM serves as eagle3)")
    config = read_json(folder / CONFIG_FILE)
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    default_k = proposals[0].get("speculative_tokens")
    if config.get("speculators_model_type") != SPECULATORS_MODEL_TYPE or not isinstance(default_k, int):
        raise ValueError(f"{folder / CONFIG_FILE}: not an EAGLE-3 speculators config (speculators_model_type "
                         f"{config.get('speculators_model_type')!r}, speculative_tokens {default_k!r}); re-export the "
                         "drafter")
    check_served_files(export_dir)
    k = num_speculative_tokens
    if k is None:
        k = (tuned_speculative_tokens(export_dir, VLLM_METHOD) if recorded else None) or default_k
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {k}")
    return {"method": VLLM_METHOD, "model": str(folder.resolve()), "num_speculative_tokens": k}


@dataclass
class VllmEagle3Settings(VllmSettings):
    """vLLM's EAGLE-3 speculator with the export's ``speculators/`` drafter
    (:class:`~inference.decoders.vllm.VllmDecoder`, ``method: eagle3``): a chain of K drafted tokens per step, each
    drafted from the drafter's own output feature, verified by the target in one pass; τ from vLLM's spec-decode
    counters. The fields of :class:`~medusa_train.engines.settings.VllmSettings`, and:

    Attributes:
        num_speculative_tokens: drafted tokens per step (K >= 1); None: the length measured fastest on this machine
            (the export's ``vllm_speculative.json``, ``benchmarks/serve_vllm.py --record``), else the export's
            ``speculative_tokens`` (the drafter's training-time-test steps).
        method: vLLM's speculative method this decoder serves (the catalog's
            :attr:`~medusa_train.models.catalog.DrafterType.vllm_method`).
    """

    num_speculative_tokens: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    method: ClassVar[str] = VLLM_METHOD


VLLM_DECODER = EngineDecoder("vllm_eagle3", "vllm", VllmEagle3Settings,
                             "vLLM's EAGLE-3 speculator with the export's speculators/ drafter (a chain of K drafts)")

__all__ = ["VLLM_DECODER", "VLLM_METHOD", "VllmEagle3Settings", "speculative_config"]
