"""File helpers for exports: JSON, safetensors and torch files written through the one durable atomic write
(:func:`medusa_train.files.atomic.atomic_write`, which also gives each file the default mode), tensor/JSON reads whose
errors name the file, checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa_train.files.atomic import atomic_write, atomic_write_text, default_mode
from medusa_train.files.text_files import read_text

# Errors a damaged file raises in safetensors / torch.load; re-raised as ValueError naming the file.
_CORRUPT = (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, ValueError, UnicodeDecodeError)


def check_export_dir(export_dir: str | os.PathLike[str]) -> None:
    """``export_dir`` holds an export's ``config.json`` (read-only: checked before the folder is locked or written).

    Raises:
        FileNotFoundError: no such folder, or a folder without ``config.json``; the message says what to pass.
    """
    if not (Path(export_dir) / "config.json").is_file():
        what = "is no such folder" if not Path(export_dir).exists() else "holds no config.json"
        raise FileNotFoundError(f"export_dir {export_dir} {what}: it is not an export written by medusa-train; pass "
                                "the export folder of a training run (e.g. export_dir=runs/NAME/export)")


def set_default_modes(folder: Path) -> None:
    """Give ``folder``, and every file and folder under it, :func:`default_mode` (for trees written by other
    libraries, e.g. ``save_pretrained`` into a ``tempfile.mkdtemp`` folder, ``0o700``, with ``0o600`` weights)."""
    os.chmod(folder, default_mode(folder=True))
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), default_mode(folder=True))
        for name in files:
            os.chmod(os.path.join(root, name), default_mode())


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    # metadata format=pt: what transformers and vLLM expect of a PyTorch safetensors file.
    atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))


def write_torch(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``torch.save`` of a plain name -> tensor dict (what FasterDecoding's loader ``torch.load``s); tensors that
    share storage are stored once."""
    atomic_write(path, lambda p: torch.save(tensors, p))


def sha256_files(paths: list[Path]) -> str:
    """Hex SHA-256 over the files' names and bytes, in the order given (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not UTF-8 (line and byte named), not valid JSON or not an object (chained to the parser's
            error).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    text = read_text(path)  # not UTF-8: the file, line and byte named
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a ``.safetensors`` file, or of a ``.pt`` state dict loaded with ``weights_only=True``, on CPU.

    Raises:
        ValueError: the file is damaged or a ``.pt`` file holds something other than a name -> tensor dict.
    """
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path), device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except _CORRUPT as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in state.items()):
        raise ValueError(f"{path} must hold a state dict (str -> tensor), got {type(state).__name__}")
    return state
