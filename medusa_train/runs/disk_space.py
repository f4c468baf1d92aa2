"""Free-space checks made before a write whose size is known: the hidden cache's blocks, a run's checkpoints and
export. A refusal names the folder, the bytes needed and free, what they are for and the ways out, before any work.

A disk that fills anyway (another job writes there too; self-distillation's replies, whose size is not known up
front) fails the write with ``ENOSPC``, ``EDQUOT`` or, past a file-size limit (``ulimit -f``; Python ignores
``SIGXFSZ``), ``EFBIG``: :func:`disk_full_named` turns those into a :class:`DiskFullError` naming the file, the bytes
the write needed and the bytes free."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GIB = 2**30  # bytes in a GiB (the planner's unit too: medusa_train.planning.terms)


# the errors of a write that found no room: no space, over quota, past the file-size limit (RLIMIT_FSIZE)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskSpaceError(OSError):
    """A folder's file system has fewer bytes free than a write planned there needs."""


class DiskFullError(DiskSpaceError):
    """A write failed for want of room (:data:`DISK_FULL_ERRNOS`); the file it wrote is named."""


def existing_parent(folder: str | os.PathLike[str]) -> Path:
    """``folder`` or, when it does not exist yet, its nearest existing parent (where it would be created)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require_free(folder: str | os.PathLike[str], needed: int, what: str, ways_out: str,
                 error: type[DiskSpaceError] = DiskSpaceError, prefix: str = "") -> None:
    """Refuse when ``folder``'s file system (``shutil.disk_usage`` of it or its nearest existing parent) has fewer
    than ``needed`` bytes free.

    Args:
        what: what the bytes are for (``"the train blocks still to build"``).
        ways_out: the fixes, as the message's last clause.
        error: the :class:`DiskSpaceError` subclass raised.
        prefix: the message's first words (whose folder it is: ``"hidden cache: "``).

    Raises:
        DiskSpaceError: ``"{folder} needs N bytes (G GiB) for {what} but its file system has F bytes (G GiB) free;
            {ways_out}"``.
    """
    free = shutil.disk_usage(existing_parent(folder)).free
    if needed > free:
        raise error(f"{prefix}{folder} needs {needed:,} bytes ({needed / GIB:.2f} GiB) for {what} but its file system has "
                    f"{free:,} bytes ({free / GIB:.2f} GiB) free; {ways_out}")


@contextmanager
def disk_full_named(path: str | os.PathLike[str], needed: int, what: str, ways_out: str) -> Iterator[None]:
    """Run the ``with`` block's write of ``path``; an ``OSError`` of :data:`DISK_FULL_ERRNOS` from it becomes a
    :class:`DiskFullError` (chained to it) that names ``path``, the ``needed`` bytes, the bytes free now and
    ``ways_out``; other errors pass unchanged.

    Args:
        needed: the bytes the write needs (a lower bound where the whole is not known: say so in ``what``).
        what: what is written (``"hidden-cache block 3"``).

    Raises:
        DiskFullError: ``"{path}: no room to write {what}: it needs N bytes (G GiB), its file system has F bytes
            (G GiB) free ({strerror}); {ways_out}"``.
    """
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL_ERRNOS or isinstance(e, DiskSpaceError):
            raise
        free = shutil.disk_usage(existing_parent(Path(path).parent)).free
        raise DiskFullError(e.errno, f"{path}: no room to write {what}: it needs {needed:,} bytes "
                            f"({needed / GIB:.2f} GiB), its file system has {free:,} bytes ({free / GIB:.2f} GiB) "
                            f"free ({e.strerror}); {ways_out}") from e


__all__ = ["DISK_FULL_ERRNOS", "DiskFullError", "DiskSpaceError", "disk_full_named", "existing_parent",
           "require_free"]
