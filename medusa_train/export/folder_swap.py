"""Replace a folder whole: the new one is written beside it and swapped in, so readers see the old or the new.

:func:`replace_folder` writes ``parent/.NAME.tmp-PID`` (same file system as the folder), carries over into it the
entries of the old folder that the writer does not own (what other commands wrote there later: a tuned tree, a model
card, an evaluation), makes it durable, then swaps it in (:func:`medusa_train.files.folders.swap_in`):

- with ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+ on ext4, xfs, btrfs, tmpfs, ...) the two folders trade places in
  one step, and the old one, now at the temporary name, is deleted;
- elsewhere the old folder is renamed to ``parent/.NAME.old-PID``, the new one renamed in, and the old one deleted.
  A process killed between these two renames leaves no folder at NAME: the next write renames the old one back.

A write that fails at any point before the swap deletes its temporary folder and leaves the old folder as it was (a
:class:`~medusa_train.runs.disk_space.DiskFullError` of a file of the new folder says so, after the file, the bytes it
needs and the cause); a write killed before the swap leaves the temporary folder, which the next write deletes. The
folder's lock (:data:`~medusa_train.runs.run_lock.EXPORT_LOCK`) is held throughout, so no two writes, and no write and a
``medusa-tune-tree`` run, overlap.

Entries are carried over as hard links (copies where the file system refuses links): the old folder is never
changed, and a re-export of a large folder (a Medusa-2 export's ``base/``) copies nothing. Every file of ours is
replaced through a temporary file and ``os.replace``, never rewritten in place, so a link cannot carry a later
change from one folder into the other.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

from medusa_train.files.atomic import fsync_dir
from medusa_train.files.folders import swap_in
from medusa_train.runs.disk_space import DiskFullError
from medusa_train.runs.run_lock import EXPORT_LOCK, RunLock

log = logging.getLogger(__name__)


def replace_folder(target: str | os.PathLike[str], write: Callable[[Path], None], owned: Collection[str],
                   field: str = "export folder") -> Path:
    """Write a new ``target`` with ``write(folder)`` and swap it in whole, keeping what others wrote in the old one.

    Args:
        target: the folder (created if missing; a symlink to a folder: the folder it points to is replaced).
        write: writes the new folder's own files into the (empty) folder it is given.
        owned: paths relative to ``target`` (``"config.json"``, ``"vllm/model.safetensors"``) that ``write`` owns:
            the old folder's copies are never carried over, whether or not ``write`` wrote them again. Every other
            entry of the old folder that ``write`` did not write is carried over (the lock file excepted).
        field: how messages name the folder.

    Returns:
        ``target``, resolved.

    Raises:
        LockHeldError: another process holds the folder's lock (a ``medusa-tune-tree`` run or another write of
            it), named; nothing is written.
        DiskFullError: a file of the new folder found no room (``write``'s own error, which names the file, the
            bytes and the cause), followed by ``"; the previous {field} {target} is left as it was"``.
        OSError: from ``write`` or the file system; the old folder is left as it was.
    """
    target = Path(target).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    _restore_left_aside(target)
    lock = RunLock.acquire(target, EXPORT_LOCK, field=field)
    try:
        _remove_leftovers(target)
        stage = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        stage.mkdir()
        try:
            os.chmod(stage, os.stat(target).st_mode & 0o7777)  # the folder keeps its own permissions
            try:
                write(stage)
            except DiskFullError as e:
                raise DiskFullError(e.errno, f"{e.strerror}; the previous {field} {target} is left as it was "
                                             "(the new one is written beside it and swapped in whole)") from e
            _sync_tree(stage)
            _carry_over(target, stage, {Path(p) for p in owned} | {Path(EXPORT_LOCK)}, Path())
            _sync_dirs(stage)
            swap_in(target, stage)
        finally:
            shutil.rmtree(stage, ignore_errors=True)  # the new folder on failure, the old one after an exchange
    finally:
        lock.release()
    return target


def _restore_left_aside(target: Path) -> None:
    """A write killed between the two renames of the fallback swap: put the old folder back at ``target``."""
    if target.exists():
        return
    aside = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if aside:
        log.warning("%s is missing and %s holds the folder a killed write left aside: restoring it", target,
                    aside[-1])
        os.rename(aside[-1], target)


def _remove_leftovers(target: Path) -> None:
    """Temporary folders of writes that were killed (this process holds the lock: none is in use)."""
    for prefix in (f".{target.name}.tmp-", f".{target.name}.old-"):
        for path in target.parent.glob(f"{prefix}*"):
            log.info("removing %s, left by a write of %s that did not finish", path, target)
            shutil.rmtree(path, ignore_errors=True)


def _carry_over(old: Path, new: Path, owned: set[Path], rel: Path) -> None:
    """Link every entry of ``old/rel`` into ``new/rel`` unless owned or already written; folders that hold owned
    paths are walked into, others linked whole."""
    for entry in sorted(os.scandir(old / rel), key=lambda e: e.name):
        path = rel / entry.name
        dest = new / path
        if path in owned:
            continue
        if entry.is_dir(follow_symlinks=False) and any(path in p.parents for p in owned):
            if not dest.exists():
                dest.mkdir()
                shutil.copystat(entry.path, dest)
            _carry_over(old, new, owned, path)
            if not any(dest.iterdir()):  # it held only owned files the new write does not have
                dest.rmdir()
        elif dest.exists() or dest.is_symlink():
            continue
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), dest)
        elif entry.is_dir():
            shutil.copytree(entry.path, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, dest)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # no hard links here (EPERM, EXDEV, EMLINK, ENOTSUP, ...)
        shutil.copy2(src, dst)


def _sync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (what ``write`` wrote)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _sync_dirs(folder)


def _sync_dirs(folder: Path) -> None:
    for root, _, _ in os.walk(folder):
        fsync_dir(Path(root))


__all__ = ["replace_folder"]
