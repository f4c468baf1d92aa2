"""The tuned tree files of an export folder: their names and their one reader.

``medusa-tune-tree`` writes them beside the heads (:mod:`medusa_train.tuning.tune`); decoders, evaluation,
publishing and the benchmarks read them through :func:`read_tree_files` (or :func:`read_latency_profile` for a
profile reused by another export's tuning run).

- ``medusa_choices.json``: the tree, a prefix-closed list of rank paths (Medusa's ``medusa_choices``).
- ``head_accuracy.json``: ``acc[k][i]``, head k's rank-i accuracy on held-out continuations, with the prompts used.
- ``latency_profile.json``: verification latency in ms by tree size (``latency_ms``), the device, the dtype and the
  kernels it was measured on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHOICES_FILE = "medusa_choices.json"
ACCURACY_FILE = "head_accuracy.json"
LATENCY_FILE = "latency_profile.json"
TREE_FILES = {"medusa_choices": CHOICES_FILE, "head_accuracy": ACCURACY_FILE, "latency_profile": LATENCY_FILE}


def read_tree_files(export_dir: str | Path) -> dict[str, Any]:
    """The tuned files of an export that exist: ``{"medusa_choices": ..., "head_accuracy": ..., ...}`` (keys of
    :data:`TREE_FILES`; a missing file is a missing key).

    Raises:
        ValueError: a file that is not valid JSON (path named).
    """
    out: dict[str, Any] = {}
    for key, name in TREE_FILES.items():
        path = Path(export_dir) / name
        if path.is_file():
            try:
                out[key] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
    return out


def read_latency_profile(export_dir: str | Path) -> dict[str, Any]:
    """The verification latency profile another tuning run wrote into ``export_dir`` (``latency_from=``), with
    ``latency_ms`` keyed by int tree size.

    Raises:
        FileNotFoundError: no profile there.
        ValueError: not valid JSON, or without ``latency_ms``, ``device`` or ``dtype``.
    """
    path = Path(export_dir) / LATENCY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"latency_from={export_dir}: {path} not found; tune that export first")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"latency_from={export_dir}: {path} is not valid JSON: {e}") from e
    missing = [k for k in ("latency_ms", "device", "dtype") if k not in raw]
    if missing:
        raise ValueError(f"latency_from={export_dir}: {path} has no {missing}")
    profile = {k: raw[k] for k in ("device", "dtype", "context_length", "repeats", "cpu_kernels") if k in raw}
    return {**profile, "latency_ms": {int(n): float(ms) for n, ms in raw["latency_ms"].items()}}


__all__ = ["ACCURACY_FILE", "CHOICES_FILE", "LATENCY_FILE", "TREE_FILES", "read_latency_profile", "read_tree_files"]
