"""Export Medusa heads in the layouts engines read (FasterDecoding / TGI, vLLM), or Hydra heads in their own, and load
them back.

- :func:`save_export`: heads -> export folder (``writer.py`` documents the layout and atomicity).
- :func:`load_heads`: our export, a FasterDecoding folder or a vLLM Medusa folder -> heads (``reader.py``).
- :func:`read_export_config`: an export's ``config.json``.
- :func:`save_base_model`: a Medusa-2 export's fine-tuned base, as ``export/base`` (``base_model.py``).
"""

from __future__ import annotations

from medusa_train.export.base_model import BASE_DIR, save_base_model
from medusa_train.export.reader import load_heads, read_export_config
from medusa_train.export.writer import save_export

__all__ = ["BASE_DIR", "load_heads", "read_export_config", "save_base_model", "save_export"]
