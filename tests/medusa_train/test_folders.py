"""publish_folder: a folder appears whole or not at all; a write-once folder keeps the first copy; a replaced one is
swapped in whole; a failed write leaves the target as it was and no temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from medusa_train.files.folders import publish_folder


def _writer(text: str):
    def write(stage: Path) -> None:
        (stage / "sub").mkdir()
        (stage / "sub" / "a.txt").write_text(text)
    return write


def test_a_write_once_folder_keeps_the_copy_published_first(tmp_path):
    target = tmp_path / "cache" / "model"
    assert publish_folder(target, _writer("first")) is True
    assert publish_folder(target, _writer("second")) is False
    assert (target / "sub" / "a.txt").read_text() == "first"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_a_rename_refused_over_an_unfinished_folder_raises(tmp_path):
    target = tmp_path / "model"
    (target / "partial").mkdir(parents=True)
    with pytest.raises(OSError):
        publish_folder(target, _writer("new"), published=lambda found: (found / "done").is_file())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert sorted(p.name for p in target.iterdir()) == ["partial"]


def test_replace_swaps_the_folder_in_whole(tmp_path):
    target = tmp_path / "base"
    publish_folder(target, _writer("old"))
    (target / "stale.txt").write_text("from the old folder")
    assert publish_folder(target, _writer("new"), replace=True) is True
    assert sorted(p.name for p in target.iterdir()) == ["sub"]
    assert (target / "sub" / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_a_failed_write_leaves_the_old_folder_and_no_temporary_one(tmp_path):
    target = tmp_path / "base"
    publish_folder(target, _writer("old"))

    def fail(stage: Path) -> None:
        (stage / "half.bin").write_bytes(b"\0" * 10)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        publish_folder(target, fail, replace=True)
    assert (target / "sub" / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
