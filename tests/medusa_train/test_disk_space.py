"""Free space checked before a write whose size is known: a run's checkpoints and export (before the output folder
changes or training starts) and the generic check's message."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from medusa_train.runs.disk_space import DiskSpaceError, existing_parent, require_free
from medusa_train.training.recipe import build_recipe
from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

Usage = namedtuple("Usage", "total used free")


def test_the_message_names_the_folder_the_bytes_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 500, 500))
    with pytest.raises(DiskSpaceError, match=rf"x: {tmp_path / 'new' / 'run'} needs 2,048 bytes \(0.00 GiB\) for "
                                             r"the things but its file system has 500 bytes \(0.00 GiB\) free; do so"):
        require_free(tmp_path / "new" / "run", 2048, "the things", "do so", prefix="x: ")
    require_free(tmp_path, 500, "exactly what is free", "")  # enough: no error
    assert existing_parent(tmp_path / "new" / "run") == tmp_path


def test_a_run_without_room_for_its_checkpoints_and_export_is_refused_before_the_folder_changes(tmp_path,
                                                                                                monkeypatch):
    model_dir, data = write_tiny_inputs(tmp_path)
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run")))
    real = shutil.disk_usage
    seen = []

    def tiny_disk(path):
        seen.append(path)
        return Usage(10**9, 10**9 - 10_000, 10_000) if str(path).startswith(str(tmp_path)) else real(path)

    monkeypatch.setattr(shutil, "disk_usage", tiny_disk)
    with pytest.raises(DiskSpaceError, match=r"output_dir: .*run needs [\d,]+ bytes .* for two checkpoints "
                                             r"\([\d,]+ bytes each: [\d,]+ trainable parameters and their Adam state\) "
                                             r"and the export .* 10,000 bytes .* free; free space there"):
        recipe.run()
    assert seen and not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "export").exists()
