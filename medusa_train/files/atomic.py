"""Durable atomic file writes: every file of ours that replaces another is written through :func:`atomic_write`.

A reader (or a run killed at any moment, or a power cut) sees the old file or the new one whole, never a part: the
new bytes go to a temporary sibling (same folder, so same file system), which is flushed to disk, renamed over the
file with ``os.replace`` (atomic on POSIX), and the folder is synced so that the rename itself survives a crash.

Every file written here gets the mode ``open()`` gives a new file (``0o666`` less the umask, typically ``0o644``):
some writers (safetensors 0.8's ``save_file``) create theirs ``0o600``, which leaves a shared folder half readable.
Whole folders are published by :func:`medusa_train.files.folders.publish_folder` and replaced by
:func:`medusa_train.export.folder_swap.replace_folder`, which sync with :func:`fsync_dir` too.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path


def umask() -> int:
    """This process's umask (read from ``/proc/self/status``; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(folder: bool = False) -> int:
    """The permission bits ``open()`` (``0o666``) or ``mkdir`` (``0o777``) gives a new file or folder here."""
    return (0o777 if folder else 0o666) & ~umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk.

    Raises:
        OSError: the folder cannot be opened, or syncing fails for a reason other than the file system not syncing
            folders (``EINVAL``, ``EBADF``, ``ENOTSUP``: then there is nothing to do).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot sync a folder
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def temp_path(path: str | os.PathLike[str]) -> Path:
    """The temporary sibling :func:`atomic_write` fills for ``path`` in this process: ``.NAME.tmp-PID``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


# a temporary sibling as temp_path names it, of any process: the target's name and the PID
TEMP_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)")


def temp_files(folder: str | os.PathLike[str], names: re.Pattern[str]) -> list[tuple[Path, re.Match[str]]]:
    """The temporary files left in ``folder`` by :func:`atomic_write` calls that were killed (``.NAME.tmp-PID``, any
    PID, files only) whose NAME matches ``names`` whole, each with that match, in name order. Removing them is the
    caller's: only it knows that no live writer of those names shares the folder.

    Raises:
        OSError: the folder cannot be listed.
    """
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        temp = TEMP_NAME.fullmatch(entry.name)
        match = names.fullmatch(temp["name"]) if temp else None
        if match and entry.is_file(follow_symlinks=False):
            found.append((Path(entry.path), match))
    return found


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Write ``path`` durably and atomically: ``write(tmp)`` fills a temporary sibling ``.NAME.tmp-PID``, which is
    fsynced, given :func:`default_mode`, renamed over ``path`` (``os.replace``), and the folder fsynced.

    Args:
        path: the file to write; its folder must exist. Other files in the folder are left alone.
        write: writes the whole new content to the path it is given (e.g. ``lambda p: p.write_text(text)``, or
            ``lambda p: save_file(tensors, str(p))``); whatever mode it creates the file with is replaced.

    Raises:
        Whatever ``write`` raises, or ``OSError`` from the file system (e.g. ``ENOSPC``): ``path`` is then left as it
        was (old content, or absent) and the temporary file is removed.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fchmod(f.fileno(), default_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write` of ``text`` in UTF-8."""
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


__all__ = ["TEMP_NAME", "atomic_write", "atomic_write_text", "default_mode", "fsync_dir", "temp_files", "temp_path",
           "umask"]
