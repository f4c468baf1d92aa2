"""What the rows of a ``medusa-eval`` run were measured with, recorded in ``run.json`` and compared on resume.

A resumed run keeps a row only if it would be measured the same way now. Two levels:

- **The run** (:func:`run_identity`): the base model config every decoder runs (the recorded ``model/`` config or
  the ``model`` override, with the ``dtype`` / ``device`` overrides applied: name, format, revision, the dtype as
  ``dtype=auto`` resolves on this machine, ...)
  and, for a Medusa-2 export whose fine-tuned base lives inside the export, the checksum of the heads written with
  it. Together with the settings every row shares (:func:`~inference.evaluation.eval_run.result_settings`:
  ``max_new_tokens``, temperature, the decoder list, ...) a change here invalidates every row: the rerun is refused,
  naming what changed, before any model loads (``overwrite=true`` starts over).
- **Each decoder** (:func:`decoder_identity`): its settings (``decoder.<name>``), what its builder resolved (e.g.
  the Medusa tree actually used, wherever it came from) and, for decoders that decode with the export's heads
  (:attr:`~inference.registry.DecoderEntry.uses_heads`), the SHA-256 of the heads' weight files. Every row carries
  the :func:`fingerprint` of its decoder's identity (``measured_with``); rows whose fingerprint differs from the
  decoder's current one are stale: they are moved to ``results_superseded.jsonl`` (never deleted) and measured again,
  the other decoders' rows are kept. This is what re-measures only Medusa after ``medusa-tune-tree`` rewrote
  ``medusa_choices.json`` or training rewrote the heads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from medusa_train.export import read_export_config
from medusa_train.export.reader import heads_checksum
from medusa_train.loading.base import resolve_device
from medusa_train.loading.export import export_base_config
from medusa_train.loading.runtime import target_config
from medusa_train.config.precision import choose_dtype

MEASURED_WITH = "measured_with"  # the run.json entry and the row field


def run_identity(export_dir: str | None, model: Any = None, dtype: str | None = None, device: str | None = None,
                 heads_sha256: str | None = None) -> dict[str, Any]:
    """What every row of a run depends on besides the run's settings (see the module docstring).

    Args:
        export_dir: the export folder; None: a run of the target ``model`` alone.
        model, dtype, device: the run's overrides (as :func:`~medusa_train.loading.export.load_export` takes them).
        heads_sha256: the heads' checksum when already computed (:func:`~medusa_train.export.reader.heads_checksum`).

    Raises:
        FileNotFoundError: no export (or no heads) there. ValueError: its config.json names no base model.
    """
    if export_dir is None:
        base = target_config(model, dtype, device)
    else:
        base = export_base_config(export_dir, read_export_config(export_dir), model, dtype, device)
    # ``dtype=auto`` is recorded as what it resolves to here: a resumed run on a machine that decides otherwise differs
    base = dataclasses.replace(base, dtype=choose_dtype(base.dtype, resolve_device(base.device)).name)
    identity: dict[str, Any] = {"base_model": dataclasses.asdict(base)}
    if export_dir is not None and Path(base.name_or_path).resolve().is_relative_to(Path(export_dir).resolve()):
        # Medusa-2: the fine-tuned base is rewritten with the heads, so the heads identify it too
        identity["base_written_with_heads_sha256"] = heads_sha256 or heads_checksum(export_dir)
    return identity


# What a builder reports about this one start of an engine (its log file, how long it took to start): recorded in
# run.json, but not what the rows were measured with, so a resumed run keeps the rows an earlier start measured.
RUN_FACTS = frozenset({"engine_log", "engine_start_s"})


def decoder_identity(settings: dict[str, Any] | None, info: dict[str, Any], heads_sha256: str | None) -> dict:
    """What one decoder's rows depend on: its settings, what its builder resolved (less :data:`RUN_FACTS`), the
    heads' checksum if it uses them (None: it does not)."""
    identity = {"settings": settings or {}, **{k: v for k, v in info.items() if k not in RUN_FACTS}}
    if heads_sha256 is not None:
        identity["heads_sha256"] = heads_sha256
    return identity


def fingerprint(identity: dict[str, Any]) -> str:
    """A short stable hash of an identity (canonical JSON), stored in each row."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``"key.sub: old -> new"`` for every leaf that differs between two JSON values (long values shortened)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {_short(old)} -> {_short(new)}"]


__all__ = ["MEASURED_WITH", "RUN_FACTS", "decoder_identity", "differences", "fingerprint", "run_identity"]
