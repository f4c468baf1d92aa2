"""File checksums (sha256), streamed so a file of several GB is never held in memory.

Used to seal what a run writes and later reuses (checkpoints, the hidden-state cache): a file can keep its size and
still be damaged (a flipped block on disk, a partial copy padded to size), and only a checksum tells.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes (64 hex digits), read in chunks.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_sha256(paths: Iterable[str | os.PathLike[str]], threads: int | None = None) -> dict[Path, str]:
    """:func:`file_sha256` of several files, hashed in parallel threads (hashlib releases the GIL while hashing).

    Args:
        paths: the files.
        threads: at most this many at once; None: one per file, at most ``os.cpu_count()`` (and 8).
    """
    paths = [Path(p) for p in paths]
    if not paths:
        return {}
    workers = threads or max(1, min(len(paths), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(paths, pool.map(file_sha256, paths)))
