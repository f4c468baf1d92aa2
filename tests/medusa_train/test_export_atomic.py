"""An export is replaced whole: a write that fails midway leaves the previous export as it was, a killed write's
temporary folder is cleaned by the next one, other commands' files survive a re-export, the files get the
permissions a new file gets, and an export is refused while the folder's lock is held."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

import medusa_train.export.files as files
from medusa_train.export import save_export
from medusa_train.models.speculative import new_heads_for
from medusa_train.runs.run_lock import EXPORT_LOCK, LockHeldError, RunLock
from tests.conftest import make_tiny_model


@pytest.fixture
def base():
    return make_tiny_model("llama")


def heads_for(base, scale: float):
    heads = new_heads_for(base, num_heads=2)
    with torch.no_grad():
        heads.block_weight.copy_(scale * torch.randn(heads.block_weight.shape,
                                                     generator=torch.Generator().manual_seed(0)))
    return heads


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_write_failing_midway_leaves_the_previous_export_byte_identical(base, tmp_path, monkeypatch):
    out = tmp_path / "export"
    save_export(heads_for(base, 1.0), out, "tiny-base", vllm=True)
    (out / "medusa_choices.json").write_text("[[0], [1]]")
    before = snapshot(out)
    assert {"config.json", "medusa_lm_head.safetensors", "vllm/model.safetensors", "vllm/config.json"} <= set(before)

    real_save = files.save_file

    def disk_full_in_vllm(tensors, path, metadata=None):
        if Path(path).parent.name == "vllm":  # the top-level heads are already written by now
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(files, "save_file", disk_full_in_vllm)
    with pytest.raises(OSError, match="No space left"):
        save_export(heads_for(base, 0.5), out, "tiny-base", vllm=True)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary folder left beside it
    assert not (out / EXPORT_LOCK).exists()


def test_a_medusa2_base_is_replaced_with_its_heads_as_one_set(base, tmp_path, monkeypatch):
    """A Medusa-2 export holds the fine-tuned base its heads fit: written with the heads (``write_also``), a failed
    heads write leaves the old heads with the old base, and a finished one replaces both."""
    from medusa_train.export import save_base_model
    from tests.conftest import make_tiny_tokenizer

    out, tokenizer = tmp_path / "export", make_tiny_tokenizer()
    save_export(heads_for(base, 1.0), out, "base", vllm=True, write_also=lambda f: save_base_model(base, tokenizer, f),
                also_owns=("base",))
    before = snapshot(out)
    assert "base/model.safetensors" in before
    retrained = make_tiny_model("llama", seed=1)
    real_save = files.save_file

    def disk_full_in_vllm(tensors, path, metadata=None):
        if Path(path).parent.name == "vllm":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(files, "save_file", disk_full_in_vllm)
    with pytest.raises(OSError, match="No space left"):
        save_export(heads_for(retrained, 0.5), out, "base", vllm=True, also_owns=("base",),
                    write_also=lambda f: save_base_model(retrained, tokenizer, f))
    assert snapshot(out) == before
    monkeypatch.setattr(files, "save_file", real_save)
    save_export(heads_for(retrained, 0.5), out, "base", vllm=False, also_owns=("base",))  # a base no longer written
    assert not (out / "base").exists() and "vllm/model.safetensors" not in snapshot(out)


def test_a_reexport_keeps_other_files_drops_its_stale_ones_and_cleans_a_killed_write(base, tmp_path):
    out = tmp_path / "export"
    save_export(heads_for(base, 1.0), out, "tiny-base", vllm=True)
    (out / "medusa_choices.json").write_text("[[0]]")
    (out / "vllm" / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "summary.json").write_text("{}")
    killed = tmp_path / f".export.tmp-{os.getpid() + 100000}"  # a write killed before its swap
    killed.mkdir()
    (killed / "config.json").write_text("{}")

    save_export(heads_for(base, 0.5), out, "tiny-base", vllm=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "config.json", "eval", "eval/summary.json", "medusa_choices.json", "medusa_lm_head.pt",
        "medusa_lm_head.safetensors", "vllm", "vllm/notes.txt"]  # vllm/'s own files are gone, the note is kept
    assert (out / "medusa_choices.json").read_text() == "[[0]]"
    from medusa_train.export import load_heads

    loaded, _ = load_heads(out)
    assert torch.equal(loaded.block_weight, heads_for(base, 0.5).block_weight)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_exported_files_get_the_mode_a_new_file_gets(base, tmp_path, mask):
    previous = os.umask(mask)
    try:
        out = save_export(heads_for(base, 1.0), tmp_path / "export", "tiny-base", vllm=True)
    finally:
        os.umask(previous)
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert {k: v for k, v in modes.items() if not (out / k).is_dir()} == {
        "config.json": 0o666 & ~mask, "medusa_lm_head.pt": 0o666 & ~mask,
        "medusa_lm_head.safetensors": 0o666 & ~mask, "vllm/config.json": 0o666 & ~mask,
        "vllm/model.safetensors": 0o666 & ~mask}
    assert modes["vllm"] == 0o777 & ~mask and out.stat().st_mode & 0o777 == 0o777 & ~mask


def test_an_export_is_refused_while_the_folder_is_held(base, tmp_path):
    out = tmp_path / "export"
    save_export(heads_for(base, 1.0), out, "tiny-base", vllm=False)
    before = snapshot(out)
    with RunLock.acquire(out, EXPORT_LOCK, field="export_dir"):  # e.g. medusa-tune-tree tuning the folder
        with pytest.raises(LockHeldError, match=f"export folder {out} is already held"):
            save_export(heads_for(base, 0.5), out, "tiny-base", vllm=False)
        assert {k: v for k, v in snapshot(out).items() if k != EXPORT_LOCK} == before
    assert json.loads((out / "config.json").read_text()) == json.loads(before["config.json"])
