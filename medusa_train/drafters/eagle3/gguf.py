"""An EAGLE-3 export's drafter as a GGUF that llama.cpp loads beside the target's GGUF, written by llama.cpp's own
converter (``convert_hf_to_gguf.py <export>/speculators --target-model-dir <target HF folder>``).

llama.cpp build 11434 (``launch/install_llamacpp.sh``, :mod:`medusa_train.engines.llamacpp_env`) reads the
speculators layout that :mod:`~medusa_train.drafters.eagle3.speculators` writes for vLLM (``Eagle3Speculator``:
``transformer_layer_config`` nested, ``layers.0.*`` / ``midlayer.*`` renamed, ``d2t`` offsets made absolute target
ids, ``t2d`` skipped, ``eagle_aux_hidden_state_layer_ids`` as its ``target_layers``; ``conversion/llama.py``), and
takes the vocabulary and
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

from medusa_train.files.atomic import atomic_write
from medusa_train.drafters.eagle3.speculators import (
    CONFIG_FILE,
    SPECULATORS_DIR,
    SPECULATORS_MODEL_TYPE,
    WEIGHTS_FILE,
    check_served_files,
)
from medusa_train.engines.llamacpp_env import BUILD_NUMBER, OUTTYPES, converter_command
from medusa_train.export.files import read_json, sha256_files, write_json

GGUF_DIR = "llamacpp"
DRAFTER_GGUF = "eagle3_drafter.gguf"
DRAFTER_RECORD = "eagle3_drafter.json"
EAGLE3_TAPS = 3  # llama.cpp's EAGLE-3 takes exactly three target layers (src/models/eagle3.cpp)


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
    """The export's ``speculators/`` folder and its config, checked for what llama.cpp's EAGLE-3 takes, and against
    the export's drafter (:func:`~medusa_train.drafters.eagle3.speculators.check_served_files`).

    Raises:
        FileNotFoundError: no ``speculators/`` (re-export with ``export_vllm=true``).
        ValueError: not an EAGLE-3 speculators config, not exactly three taps (the taps named), or files that are
            not what the export wrote (tensors, other weights files, sha256; the file named).
    """
    folder = Path(export_dir) / SPECULATORS_DIR
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_FILE} / {WEIGHTS_FILE} not found: llama.cpp's converter reads the "
                                "EAGLE-3 drafter in the speculators layout; re-export the drafter with "
                                "export_vllm=true (heads=eagle3)")
    config = read_json(folder / CONFIG_FILE)
    if config.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
        raise ValueError(f"{folder / CONFIG_FILE}: speculators_model_type is "
                         f"{config.get('speculators_model_type')!r}, not {SPECULATORS_MODEL_TYPE!r}: only EAGLE-3 "
                         "drafters convert")
    taps = config.get("eagle_aux_hidden_state_layer_ids") or []
    if len(taps) != EAGLE3_TAPS:
        raise ValueError(f"{folder / CONFIG_FILE}: eagle_aux_hidden_state_layer_ids {taps}: llama.cpp's EAGLE-3 "
                         f"reads exactly {EAGLE3_TAPS} target layers; train with three heads.feature_layers")
    check_served_files(export_dir)
    return folder, config


def export_eagle3_gguf(export_dir: str | os.PathLike[str], target_model_dir: str | os.PathLike[str],
                       outtype: str = "f32", force: bool = False, timeout: float = 1800.0) -> Path:
    """Convert the export's EAGLE-3 drafter (``speculators/``) into ``llamacpp/eagle3_drafter.gguf`` with llama.cpp's
    converter, unless the file there was converted from the same speculators files with the same ``outtype``.

    Args:
        export_dir: an EAGLE-3 export written with ``export_vllm=true``.
        target_model_dir: the target's HF folder (config and tokenizer; its weights are not read).
        outtype: the drafter's weight type in the GGUF, one of
            :data:`~medusa_train.engines.llamacpp_env.OUTTYPES` (``d2t`` stays int64).
        force: convert even when the recorded conversion matches.
        timeout: seconds the converter may take.

    Returns:
        The GGUF's path. It is written to a temporary sibling and renamed into place, its record after it: a killed
        conversion leaves the previous file (or none), never a partial one.

    Raises:
        ValueError: ``outtype`` not in :data:`~medusa_train.engines.llamacpp_env.OUTTYPES`, or the checks of
            :func:`speculators_files`.
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
    "DRAFTER_GGUF",
    "GGUF_DIR",
    "check_target_folder",
    "drafter_gguf_path",
    "export_eagle3_gguf",
    "speculators_files",
]
