"""Atomic checkpoints on top of the HF Trainer's ``checkpoint-N`` folders.

The Trainer writes a checkpoint as many files (weights, optimizer and scheduler states, RNG states, DeepSpeed shards
from every rank, ``trainer_state.json``); a run killed in the middle leaves a folder that looks like a checkpoint but
is not one. Here a checkpoint counts only once it holds :data:`COMPLETE_MARKER`, written by the main process after
every rank finished saving (a barrier), atomically (:func:`medusa_train.files.atomic.atomic_write`), listing each file
with its size and sha256. A folder counts as complete while its marker is present and its files keep the recorded
sizes (cheap, on every rank); before a resume the main process also checks the sha256 of the newest checkpoints
(:func:`remove_incomplete` with ``verify_latest``), so that a file damaged in place (same size) is caught, that
checkpoint removed with a warning and the previous complete one resumed instead. Rotation (``save_total_limit``) is
done here too, after marking, so an old complete checkpoint is never deleted before the new one is complete.

Hashing costs one read of the checkpoint right after it was written (mostly from the page cache): measured with
``benchmarks/checkpoint_hash.py`` (on SmolLM2-135M's heads, about as long as writing the checkpoint on a
loaded 2-core CPU; a small share of a run that saves every few hundred steps).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from medusa_train.files.atomic import atomic_write_text
from medusa_train.files.checksums import files_sha256

log = logging.getLogger(__name__)

COMPLETE_MARKER = "medusa_checkpoint_complete.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _files_with_sizes(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def mark_complete(folder: str | os.PathLike[str], step: int, world_size: int = 1) -> Path:
    """Write the completeness marker into a fully saved checkpoint folder (main process, after a barrier), with the
    number of ranks that wrote it (a resume must have as many: see :func:`saved_world_size`).

    Raises:
        FileNotFoundError: ``folder`` does not exist.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} not found")
    files = _files_with_sizes(folder)
    digests = files_sha256(folder / name for name in files)
    payload = {"global_step": int(step), "world_size": int(world_size), "files": files,
               "sha256": {name: digests[folder / name] for name in files}}
    atomic_write_text(folder / COMPLETE_MARKER, json.dumps(payload, indent=1))
    return folder / COMPLETE_MARKER


def incomplete_reason(folder: str | os.PathLike[str], verify: bool = False) -> str | None:
    """None for a complete checkpoint, else why it is not (marker missing or unreadable, file missing or resized;
    with ``verify``, also a file whose sha256 differs from the one recorded at save time).

    Markers written before checksums were recorded are checked by size only.
    """
    folder = Path(folder)
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return f"no {COMPLETE_MARKER} (the save was interrupted)"
    try:
        payload = json.loads(marker.read_text())
        files = payload["files"]
        recorded = payload.get("sha256") or {}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {COMPLETE_MARKER}: {e}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when saved"
    if verify:
        digests = files_sha256(folder / name for name in files if name in recorded)
        for name in files:
            if name in recorded and digests[folder / name] != recorded[name]:
                return f"{name} is damaged: its sha256 differs from the one recorded when it was saved (same size)"
    return None


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CHECKPOINT_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_complete(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or None; newer incomplete ones are logged and skipped."""
    for step, folder in reversed(list_checkpoints(root)):
        reason = incomplete_reason(folder)
        if reason is None:
            return folder
        log.warning("skipping incomplete checkpoint %s: %s", folder, reason)
    return None


def saved_world_size(root: str | os.PathLike[str]) -> int | None:
    """The number of ranks that wrote the newest complete checkpoint under ``root`` (None: none, or not recorded)."""
    for _, folder in reversed(list_checkpoints(root)):
        if incomplete_reason(folder) is None:
            value = json.loads((folder / COMPLETE_MARKER).read_text()).get("world_size")
            return int(value) if value is not None else None
    return None


def remove_incomplete(root: str | os.PathLike[str], verify_latest: bool = False) -> list[Path]:
    """Delete the incomplete ``checkpoint-N`` folders under ``root`` (main process only); returns them, oldest first.

    With ``verify_latest`` (before a resume) the checksums of the newest checkpoints are checked too, newest first,
    until one passes: the one :func:`latest_complete` then picks on every rank. Older ones are checked by size.
    """
    removed = []
    verify = verify_latest
    for _, folder in reversed(list_checkpoints(root)):
        reason = incomplete_reason(folder, verify=verify)
        if reason is None:
            verify = False
            continue
        log.warning("removing unusable checkpoint %s: %s%s", folder, reason,
                    "; the previous complete checkpoint is used instead" if verify else "")
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed[::-1]


def rotate(root: str | os.PathLike[str], keep: int | None) -> list[Path]:
    """Keep the ``keep`` newest complete checkpoints under ``root`` and delete older ones; None keeps all.

    Incomplete folders are left alone here (a save may be in progress); :func:`remove_incomplete` handles them.
    """
    if keep is None or keep <= 0:
        return []
    complete = [folder for _, folder in list_checkpoints(root) if incomplete_reason(folder) is None]
    doomed = complete[:-keep]
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed
