"""The one durable atomic write (``medusa_train.files.atomic``): a write that fails midway leaves the old file as it was and
no temporary file; a write that succeeds flushes the file, then the folder after the rename; and no other module
hand-rolls one (every ``os.replace`` of ours is in it, or renames a whole folder)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest

import medusa_train.files.atomic as atomic
from medusa_train.files.atomic import atomic_write, atomic_write_text
from medusa_train.files.paths import REPO_ROOT
from medusa_train.training import checkpoints


def test_a_write_failing_midway_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"step": 1}\n')
    os.chmod(path, 0o640)
    seen = []

    def half_then_full_disk(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text('{"step": 2, "files": [')  # the first half of the new content
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    with pytest.raises(OSError, match="No space left on device"):
        atomic_write(path, half_then_full_disk)
    assert path.read_text() == '{"step": 1}\n' and oct(path.stat().st_mode & 0o777) == oct(0o640)
    assert seen[0].parent == tmp_path and seen[0] != path  # written beside the file, under another name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_a_failing_first_write_leaves_no_file_at_all(tmp_path):
    def fails(tmp: Path) -> None:
        tmp.write_bytes(b"\0" * 10)
        raise ValueError("cannot serialize")

    with pytest.raises(ValueError, match="cannot serialize"):
        atomic_write(tmp_path / "new.bin", fails)
    assert list(tmp_path.iterdir()) == []


def test_a_write_syncs_the_new_file_then_the_folder_after_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "summary.md"
    path.write_text("old")
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((target, target.is_dir() or path.read_text()))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", recording_fsync)
    atomic_write_text(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert oct(path.stat().st_mode & 0o777) == oct(atomic.default_mode())
    (file_synced, content_then), (folder_synced, is_dir) = synced
    assert file_synced.parent == tmp_path and file_synced.name.startswith(".summary.md.tmp-")
    assert content_then == "old"  # the file is on disk before it replaces the old one
    assert folder_synced == tmp_path and is_dir is True  # ... and the rename is made durable after


def test_the_checkpoint_marker_goes_through_it(tmp_path, monkeypatch):
    """A writer that hand-rolled its own (the checkpoint marker) now fails like the helper: old marker kept."""
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 8)
    marker = checkpoints.mark_complete(folder, 5)
    before = marker.read_bytes()
    (folder / "weights.bin").write_bytes(b"v" * 9)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        checkpoints.mark_complete(folder, 6)
    assert marker.read_bytes() == before and json.loads(before)["global_step"] == 5
    assert sorted(p.name for p in folder.iterdir()) == [checkpoints.COMPLETE_MARKER, "weights.bin"]


# Whole-folder renames, not file writes: the converted-model cache (a folder renamed into place once) and a Medusa-2
# export's base/ (saved by save_pretrained into a temporary folder). The export's folder swap uses os.rename.
FOLDER_RENAMES = {"medusa_train/loading/base.py", "medusa_train/export/base_model.py"}


def test_no_module_hand_rolls_an_atomic_write():
    root = Path(REPO_ROOT)
    found = {}
    for package in ("medusa_train", "inference"):
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            hits = re.findall(r"\bos\.replace\(", path.read_text(encoding="utf-8"))
            if hits and rel not in FOLDER_RENAMES | {"medusa_train/files/atomic.py"}:
                found[rel] = len(hits)
    assert found == {}, f"use medusa_train.files.atomic.atomic_write instead of renaming a temporary file: {found}"
