"""An export is replaced whole: a write that fails midway leaves the previous export as it was, a full disk is named
(the file, the bytes it needs, the cause) instead of the library's own words, a killed write's temporary folder is
cleaned by the next one, other commands' files survive a re-export, the files get the permissions a new file gets,
and an export is refused while the folder's lock is held."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import medusa_train.export.files as files
from medusa_train.runs.disk_space import DiskFullError
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


Usage = namedtuple("Usage", "total used free")  # shutil.disk_usage's result


def full_disk_message(path: str, what: str, needed: int, cause: str, out: Path,
                      free: str = r"[\d,]+ bytes \([\d.]+ GiB\)") -> str:
    """The regex a DiskFullError of an export file matches: the file, the bytes, the cause, the export kept."""
    return (rf"{re.escape(path)}: no room to write {re.escape(what)}: it needs {needed:,} bytes \(0\.00 GiB\), its "
            rf"file system has {free} free \({re.escape(cause)}\); free that much space there, or "
            rf"give the run an output_dir on a larger disk; the previous export folder {re.escape(str(out))} is left "
            "as it was")


def test_a_full_disk_in_safetensors_or_torch_save_names_the_file_the_bytes_and_the_cause(base, tmp_path, monkeypatch):
    """safetensors says ``File too large (os error 27)`` and torch.save ``unexpected pos`` (no errno): each becomes a
    DiskFullError naming the file being written, the bytes it needs (the size the file has when written whole) and
    the cause, and the previous export stays byte-identical."""
    out = tmp_path / "export"
    save_export(heads_for(base, 1.0), out, "tiny-base", vllm=True)
    before = snapshot(out)
    stage = f"{tmp_path}/.export.tmp-{os.getpid()}"
    real_save = files.save_file

    def too_large_in_vllm(tensors, path, metadata=None):
        if Path(path).parent.name == "vllm":  # safetensors' own words for EFBIG
            raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(files, "save_file", too_large_in_vllm)
    vllm_size = len(before["vllm/model.safetensors"])
    with pytest.raises(DiskFullError, match=full_disk_message(
            f"{stage}/vllm/model.safetensors", "model.safetensors (6 tensors)", vllm_size, "File too large", out)) as e:
        save_export(heads_for(base, 0.5), out, "tiny-base", vllm=True)
    assert e.value.errno == errno.EFBIG
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    monkeypatch.setattr(files, "save_file", real_save)

    def short_write(obj, f, *args, **kwargs):  # what torch's zip writer raises on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", short_write)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 500, 500))  # the disk is full
    heads = heads_for(base, 0.5)
    weights = sum(t.numel() * t.element_size() for t in heads.state_dict().values())  # one copy of each tensor
    with pytest.raises(DiskFullError, match=full_disk_message(
            f"{stage}/medusa_lm_head.pt", "medusa_lm_head.pt (6 tensors; at least their bytes)", weights,
            "No space left on device (a short write)", out, free=r"500 bytes \(0\.00 GiB\)")) as e:
        save_export(heads, out, "tiny-base", vllm=True)
    assert e.value.errno == errno.ENOSPC and weights < len(before["medusa_lm_head.pt"])
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


EXPORT_SCRIPT = """
import sys
from medusa_train.runs.disk_space import DiskFullError
from tests.conftest import make_tiny_model
from tests.medusa_train.test_export_atomic import heads_for
from medusa_train.export import save_export
try:
    save_export(heads_for(make_tiny_model("llama"), 0.5), sys.argv[1], "tiny-base", vllm=sys.argv[2] == "vllm",
                fasterdecoding=sys.argv[2] == "pt")
except DiskFullError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.slow  # two subprocesses: about 20 s on 2 shared cores
def test_a_real_file_size_limit_in_safetensors_and_torch_save_is_named_and_keeps_the_export(base, tmp_path):
    """The real libraries past a real file-size limit (``ulimit -f``): safetensors' and torch.save's errors become
    one message naming the file, its bytes and the limit, and the previous export is untouched."""
    from tests.medusa_train.test_faults import under_file_size_limit

    out = tmp_path / "export"
    save_export(heads_for(base, 1.0), out, "tiny-base", vllm=True)
    before = snapshot(out)
    sizes = {name: len(before[name]) for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt",
                                                  "vllm/model.safetensors")}
    limit = sizes["medusa_lm_head.safetensors"] + 8  # the heads' safetensors file is written, then the limit is met
    assert limit < min(sizes["medusa_lm_head.pt"], sizes["vllm/model.safetensors"])
    stage = f"{tmp_path}/.export.tmp-"
    for kind, name in [("vllm", "vllm/model.safetensors"), ("pt", "medusa_lm_head.pt")]:
        result = under_file_size_limit(limit, EXPORT_SCRIPT, out, kind)
        assert result.returncode == 3, result.stderr[-3000:]
        assert result.stdout.startswith("[Errno 27] " + stage) and f"/{name}: no room to write" in result.stdout
        if kind == "vllm":  # safetensors plans its size exactly
            assert f"it needs {sizes[name]:,} bytes" in result.stdout and "(File too large)" in result.stdout
        else:
            assert f"(File too large: the file-size limit (ulimit -f) is {limit:,} bytes)" in result.stdout
        assert f"the previous export folder {out} is left as it was" in result.stdout
        assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


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
