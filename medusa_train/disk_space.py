"""Free-space checks made before a write whose size is known: the hidden cache's blocks, a run's checkpoints and
export. A refusal names the folder, the bytes needed and free, what they are for and the ways out, before any work."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

GIB = 2**30


class DiskSpaceError(OSError):
    """A folder's file system has fewer bytes free than a write planned there needs."""


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


__all__ = ["DiskSpaceError", "existing_parent", "require_free"]
