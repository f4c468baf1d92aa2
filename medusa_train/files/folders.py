"""Publish a whole folder: written under a temporary name beside it and renamed into place, so a reader or a killed
run sees the old folder (or none) or the new one whole, never half of one.

- :func:`publish_folder`: the one way a folder of ours appears whole: a converted model in the conversion cache
  (:mod:`medusa_train.loading.base`), a tokenized dataset (:mod:`medusa_train.data.tokenized_cache`), a Medusa-2
  export's ``base/`` (:mod:`medusa_train.export.base_model`). Write-once folders keep the first copy when two
  processes publish the same one; a replaced folder is swapped in whole.
- :func:`swap_in`: put a finished folder in place of another in one step (``renameat2(RENAME_EXCHANGE)``), or by two
  renames where the system cannot; :func:`medusa_train.export.folder_swap.replace_folder` builds on it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from medusa_train.files.atomic import fsync_dir

log = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def publish_folder(target: str | os.PathLike[str], write: Callable[[Path], None], *, replace: bool = False,
                   published: Callable[[Path], bool] | None = None) -> bool:
    """Write a new folder with ``write(stage)`` into ``.NAME.tmp-HOST-PID`` beside ``target``, then rename it to
    ``target`` whole.

    Args:
        target: the folder to publish (its parent is created if missing).
        write: writes the folder's files into the empty folder it is given.
        replace: an existing ``target`` is replaced whole (:func:`swap_in`; nothing of it is kept). False: the
            folder is written once, and when another process published ``target`` first its copy is kept and this
            one dropped (both hold the same content).
        published: with ``replace=False``, whether a ``target`` found in place is whole (default: it exists).

    Returns:
        True when this call's folder is at ``target``; False when another process's copy was kept.

    Raises:
        OSError: from ``write`` or the file system (the rename refused while ``target`` is not ``published``). The
            temporary folder is removed in every case and ``target`` is left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)  # left by a killed write of this process id
    stage.mkdir()
    try:
        write(stage)
        if replace and target.exists():
            swap_in(target, stage)
            return True
        try:
            os.rename(stage, target)
        except OSError:  # another process published it first (the target exists and is not empty)
            if not (published or Path.exists)(target):
                raise
            log.info("%s was published by another process; keeping it", target)
            return False
        fsync_dir(target.parent)
        return True
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # the new folder on failure, the old one after an exchange


def swap_in(target: Path, stage: Path) -> None:
    """Put ``stage`` at ``target``; the old folder ends up at ``stage``'s name (exchange) or is deleted.

    Elsewhere than ``renameat2`` the old folder is renamed to ``.NAME.old-PID`` first: a process killed between the
    two renames leaves no folder at ``target`` (:func:`medusa_train.export.folder_swap.replace_folder` renames it
    back on its next write).

    Raises:
        OSError: ``renameat2`` failed for another reason than the system not supporting it.
    """
    if not _exchange(stage, target):
        aside = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, aside)
        os.rename(stage, target)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with ``renameat2(RENAME_EXCHANGE)``; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc 2.28+ (or not Linux)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


__all__ = ["publish_folder", "swap_in"]
