"""File helpers for exports: JSON, safetensors and torch files written through the one durable atomic write
(:func:`medusa_train.files.atomic.atomic_write`, which also gives each file the default mode), tensor/JSON reads whose
errors name the file, checksums.

A tensor file that does not fit (a full disk, a quota, the file-size limit) fails with a
:class:`~medusa_train.runs.disk_space.DiskFullError` naming the file, the bytes it needs, the bytes free and the cause
(:func:`~medusa_train.runs.disk_space.disk_full_named`), not safetensors' ``File too large`` or torch's ``unexpected
pos``; the file's temporary sibling is removed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from medusa_train.files.atomic import atomic_write, atomic_write_text, default_mode
from medusa_train.runs.disk_space import disk_full_named
from medusa_train.files.paths import resolve_path
from medusa_train.files.safetensors_stream import TensorPlan, planned_size
from medusa_train.files.text_files import read_text

# Errors a damaged file raises in safetensors / torch.load; re-raised as ValueError naming the file.
_CORRUPT = (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, ValueError, UnicodeDecodeError)


def check_readable(folder: str | os.PathLike[str] | None, field: str = "export_dir") -> None:
    """Refuse an export this process cannot read whole, before anything reads it: ``folder`` and every folder under
    it must list, and every file in them open for reading (each is opened and closed, nothing read; what the
    readers meet, ACLs and capabilities included). Entries whose names start with a dot (temporary files of a write
    in progress, Hydra's ``.tune_tree/``) and symbolic links to folders are not walked into. None, or a ``folder``
    that does not exist, passes: whoever needs it names it missing.

    Raises:
        PermissionError: ``"{field}={folder}: {path} has no read permission for this user ({what}); ..."``, naming
            the first file or folder that cannot be read and the fix (``chmod -R a+rX``).
        ValueError: ``folder`` is on a symlink loop (:func:`~medusa_train.files.paths.resolve_path`, the links named).
    """
    if folder is None:
        return
    root = Path(folder)
    resolve_path(root, field)

    def refuse(path: str | os.PathLike[str], what: str) -> PermissionError:
        error = PermissionError(f"{field}={root}: {path} has no read permission for this user ({what}); an export "
                                f"is read whole: give this user read access (e.g. chmod -R a+rX {root}), or run as "
                                "the user who wrote it")
        error.errno = errno.EACCES  # (a filename would replace the message in str())
        return error

    try:
        os.stat(root)
    except FileNotFoundError:
        return
    except PermissionError:
        raise refuse(root, "a folder above it cannot be entered") from None
    pending = [root]
    while pending:
        path = pending.pop()
        try:
            with os.scandir(path) as listing:
                entries = sorted((e for e in listing if not e.name.startswith(".")), key=lambda e: e.name)
        except NotADirectoryError:  # the root is a file: whoever needs a folder names it
            return
        except PermissionError:
            raise refuse(path, "a folder that cannot be listed") from None
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                else:
                    os.close(os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK))
            except PermissionError:
                raise refuse(entry.path, "it cannot be opened") from None
            except OSError:  # gone since it was listed, a dangling link, ...: the reader names it
                pass


def check_export_dir(export_dir: str | os.PathLike[str]) -> None:
    """``export_dir`` holds an export's ``config.json`` and can be read whole (:func:`check_readable`), read-only:
    checked before the folder is locked or written.

    Raises:
        FileNotFoundError: no such folder, or a folder without ``config.json``; the message says what to pass.
        PermissionError: a file or folder of the export this user cannot read (:func:`check_readable`).
        ValueError: ``export_dir`` is on a symlink loop (named).
    """
    check_readable(export_dir)
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


# how a DiskFullError of an export file ends (the export is written beside the previous one: folder_swap.py)
FULL_WAYS_OUT = "free that much space there, or give the run an output_dir on a larger disk"
_FORMAT_PT = {"format": "pt"}  # safetensors metadata: what transformers and vLLM expect of a PyTorch file


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as a safetensors file (metadata ``format: pt``).

    Raises:
        DiskFullError: no room for the file's bytes (its planned size named, as
            :func:`~medusa_train.files.safetensors_stream.planned_size` counts them); ``path`` is left as it was.
    """
    try:
        size = planned_size([TensorPlan(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], _FORMAT_PT)
    except ValueError:  # a dtype the planner has no name for: the tensors' bytes alone
        size = sum(v.numel() * v.element_size() for v in tensors.values())
    with disk_full_named(path, size, f"{path.name} ({len(tensors)} tensors)", FULL_WAYS_OUT):
        atomic_write(path, lambda p: save_file(tensors, str(p), metadata=_FORMAT_PT))


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the tensors' storages, each counted once (tied or shared weights are stored once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def write_torch(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``torch.save`` of a plain name -> tensor dict (what FasterDecoding's loader ``torch.load``s); tensors that
    share storage are stored once.

    Raises:
        DiskFullError: no room for the file (the bytes named: its tensors' storages, a lower bound of the zip
            file's size); ``path`` is left as it was.
    """
    what = f"{path.name} ({len(tensors)} tensors; at least their bytes)"
    with disk_full_named(path, storage_bytes(tensors.values()), what, FULL_WAYS_OUT):
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
