"""How an engine serves the repeat drafter: its engine files (``repeat_vllm/``, written by its engine writer), its
vLLM mapping (method ``repeat``, the ``speculative_config`` of an export) and its engine decoder ``vllm_repeat`` with
its settings. No real vLLM serves a repeat drafter: the tests serve it with a fake engine
(:mod:`tests.toy_drafter.fake_engine`) that reads what a real one would."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from medusa_train.config.bounds import MAX_COUNT, bound
from medusa_train.models.catalog import EngineDecoder
from medusa_train.engines.settings import VllmSettings
from medusa_train.export.files import read_json, write_json

VLLM_METHOD = "repeat"  # the speculative method the fake engine serves it as
ENGINE_DIR = "repeat_vllm"  # the engine's files in an export
CONFIG_FILE = "config.json"


def repeat_vllm_writer(heads: Any, *, base_model_name_or_path: str, base_model: Any = None
                       ) -> Callable[[Path], None]:
    """The writer of ``repeat_vllm/`` for ``heads`` (the export calls it when ``export_vllm=true``): the drafter's
    number of heads and scale, what the engine drafts with."""
    config = {"method": VLLM_METHOD, "num_heads": heads.spec.num_heads, "scale": heads.spec.scale,
              "verifier": base_model_name_or_path}

    def write(folder: Path) -> None:
        (folder / ENGINE_DIR).mkdir(exist_ok=True)
        write_json(folder / ENGINE_DIR / CONFIG_FILE, config)

    return write


def speculative_config(export_dir: str | os.PathLike[str], num_speculative_tokens: int | None = None,
                       recorded: bool = True) -> dict[str, Any]:
    """The engine's ``speculative_config`` for a repeat export: ``{"method": "repeat", "model": <export>/repeat_vllm,
    "num_speculative_tokens": K}`` (K: its heads unless given).

    Raises:
        FileNotFoundError: no ``repeat_vllm/config.json`` (export with ``export_vllm=true``).
    """
    folder = Path(export_dir) / ENGINE_DIR
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} not found: export the repeat heads with export_vllm=true")
    k = num_speculative_tokens or read_json(folder / CONFIG_FILE)["num_heads"]
    return {"method": VLLM_METHOD, "model": str(folder.resolve()), "num_speculative_tokens": k}


@dataclass
class VllmRepeatSettings(VllmSettings):
    """The repeat drafter in the engine: the fields of :class:`~medusa_train.engines.settings.VllmSettings`, and:

    Attributes:
        num_speculative_tokens: drafted tokens per step; None: the export's heads.
    """

    num_speculative_tokens: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    method: ClassVar[str] = VLLM_METHOD


VLLM_DECODER = EngineDecoder("vllm_repeat", "vllm", VllmRepeatSettings,
                             "the repeat drafter in the (fake) vLLM engine")

__all__ = ["ENGINE_DIR", "VLLM_DECODER", "VLLM_METHOD", "VllmRepeatSettings", "repeat_vllm_writer",
           "speculative_config"]
