"""The run folder of a benchmark script on ``medusa-eval``'s runner (``medusa_speed.py``, ``medusa2_vs_medusa1.py``):
``OUT/results.jsonl`` (:class:`~inference.evaluation.results.ResultsLog`: one row per prompt, turn and decoder,
synced row by row) resumed only under the settings recorded beside it in ``OUT/settings.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inference.evaluation.results import RESULTS_FILE, ResultsLog
from medusa_train.files.atomic import atomic_write_text

SETTINGS_FILE = "settings.json"


def open_log(out: Path, settings: dict[str, Any]) -> ResultsLog:
    """``OUT/results.jsonl``, resumed when ``OUT/settings.json`` holds the same settings.

    Raises:
        ValueError: ``OUT`` holds rows of other settings (each differing setting named) or rows without their
            settings file; nothing in it is changed.
    """
    recorded_path = out / SETTINGS_FILE
    if (out / RESULTS_FILE).is_file():
        if not recorded_path.is_file():
            raise ValueError(f"{out / RESULTS_FILE} exists without its {SETTINGS_FILE}: choose another --output-dir")
        recorded = json.loads(recorded_path.read_text())
        diffs = [f"{k}: {recorded.get(k)!r} there, {v!r} now" for k, v in settings.items() if recorded.get(k) != v]
        if diffs:
            raise ValueError(f"{out} holds rows of other settings ({'; '.join(diffs)}): choose another --output-dir")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(recorded_path, json.dumps(settings, indent=1))
    return ResultsLog(out / RESULTS_FILE)
