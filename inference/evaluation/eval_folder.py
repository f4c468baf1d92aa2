"""The output folder of a ``medusa-eval`` run: written only when it is new, empty or one of ours, and held by one
run at a time.

- :func:`check_eval_dir`: a folder holding anything but a medusa-eval run is refused (some of its entries named),
  before any model loads and before anything in it is written or deleted, even with ``overwrite=true``. A folder is
  a run of ours when its ``run.json`` carries ``"tool": "medusa-eval"`` (:data:`TOOL_KEY`, written by every run
  before its first row), or has the keys every earlier run wrote (``config``, ``environment``, ``decoders``). What
  Hydra writes into the folder before the run starts (``.hydra/``, the job's ``.log``) and the lock file of a killed
  run do not make it someone else's.
- :func:`hold_eval_dir`: the folder's lock (:data:`~medusa_train.runs.run_lock.EVAL_LOCK`, see
  :class:`~medusa_train.runs.run_lock.RunLock`), held for the run's whole life: a second run into the folder is refused,
  naming the first (two runs would append every row twice).

A sweep (``medusa-eval -m``) writes each job into its own numbered folder, each checked and held as one run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path

from medusa_train.files.paths import resolve_path
from medusa_train.runs.run_lock import EVAL_LOCK, RunLock

TOOL = "medusa-eval"
TOOL_KEY = "tool"
RUN_FILE = "run.json"
_EARLIER_RUN_KEYS = ("config", "environment", "decoders")  # run.json of a run before TOOL_KEY was written


class EvalDirError(ValueError):
    """``output_dir`` holds files that are not a medusa-eval run."""


def is_our_run(folder: Path) -> bool:
    """Whether ``folder/run.json`` was written by a medusa-eval run (see the module docstring)."""
    try:
        data = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    return data.get(TOOL_KEY) == TOOL or all(key in data for key in _EARLIER_RUN_KEYS)


def hydra_entries() -> set[str]:
    """What Hydra wrote into the running job's folder before the task started
    (:func:`medusa_train.cli.app.hydra_entries`); none outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    from medusa_train.cli.app import hydra_entries as entries_of

    return entries_of(HydraConfig.get()) if HydraConfig.initialized() else set()


def check_eval_dir(out: str | os.PathLike[str], ignored: Collection[str] = ()) -> None:
    """Refuse an ``output_dir`` that holds anything but a medusa-eval run (read-only).

    Args:
        out: the run's folder (need not exist).
        ignored: entries another program put there for this run (:func:`hydra_entries`).

    Raises:
        EvalDirError: ``out`` is a file, on a symlink loop (the links named), or a folder with entries other than
            ``ignored`` and a lock file whose ``run.json`` is not a medusa-eval run's; the message names the folder,
            some entries and the fix.
    """
    resolve_path(out, "output_dir", EvalDirError)
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise EvalDirError(f"output_dir {root} is a file, not a folder: choose a folder for the evaluation")
    if not root.is_dir():
        return
    entries = sorted(set(os.listdir(root)) - set(ignored) - {EVAL_LOCK})
    if not entries or is_our_run(root):
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    raise EvalDirError(
        f"output_dir {root} holds files that are not a medusa-eval run ({shown}): medusa-eval writes only into a "
        f"new or empty folder or one of its own runs (whose {RUN_FILE} it wrote), and never over other files, even "
        "with overwrite=true; choose another output_dir (e.g. a new folder inside this one)")


def hold_eval_dir(out: str | os.PathLike[str]) -> RunLock:
    """Take ``out``'s lock (created if missing) for this run; release it with :meth:`RunLock.release`.

    Raises:
        LockHeldError: another run holds the folder (its pid, host, start time and command named).
    """
    return RunLock.acquire(out, EVAL_LOCK, field="output_dir")


__all__ = ["TOOL", "TOOL_KEY", "EvalDirError", "check_eval_dir", "hold_eval_dir", "hydra_entries", "is_our_run"]
