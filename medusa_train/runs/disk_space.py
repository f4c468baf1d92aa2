"""Free-space checks made before a write whose size is known: the hidden cache's blocks, a run's checkpoints and
export. A refusal names the folder, the bytes needed and free, what they are for and the ways out, before any work.

A disk that fills anyway (another job writes there too; self-distillation's replies, whose size is not known up
front) fails the write with ``ENOSPC``, ``EDQUOT`` or, past a file-size limit (``ulimit -f``; Python ignores
``SIGXFSZ``), ``EFBIG``: :func:`disk_full_named` turns those into a :class:`DiskFullError` naming the file, the bytes
the write needed and the bytes free. Libraries that write files themselves say so in their own words, which
:func:`disk_full_cause` reads: safetensors (Rust) ends its ``SafetensorError`` with ``(os error 28)``, and
``torch.save``'s zip writer raises ``RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...``
after a short write, with no error number at all."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

GIB = 2**30  # bytes in a GiB (the planner's unit too: medusa_train.planning.terms)


# the errors of a write that found no room: no space, over quota, past the file-size limit (RLIMIT_FSIZE)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# the end of a Rust std::io::Error's message (safetensors' SafetensorError): "... File too large (os error 27)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# torch.save's PyTorchStreamWriter after a short write (a full disk or the file-size limit; it keeps no errno)
_TORCH_SHORT_WRITE = re.compile(r"inline_container\.cc:\d+\]\s*\.\s*unexpected pos")


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


def disk_full_cause(error: BaseException, needed: int, free: Callable[[], int]) -> tuple[int, str] | None:
    """``(errno, cause)`` when ``error`` is a write's failure for want of room, else None.

    Read from an ``OSError``'s errno (:data:`DISK_FULL_ERRNOS`) or a safetensors error's ``(os error N)``.
    ``torch.save``'s short write (``unexpected pos``) names no cause; it is read from what this process can see:
    ``EFBIG`` (the limit named) where a file-size limit (``RLIMIT_FSIZE``, ``ulimit -f``) is set and either is
    below the ``needed`` bytes or the file system has room for them (``free()``: its bytes free), ``ENOSPC`` where
    it has not, ``EDQUOT`` (a quota, which ``statvfs`` does not show) where it has and no limit is set.
    """
    if isinstance(error, DiskSpaceError):
        return None
    if isinstance(error, OSError):
        return (error.errno, error.strerror or os.strerror(error.errno)) if error.errno in DISK_FULL_ERRNOS else None
    text = str(error)
    if (found := _RUST_OS_ERROR.search(text)) is not None:
        code = int(found[1])
        return (code, os.strerror(code)) if code in DISK_FULL_ERRNOS else None
    if not (isinstance(error, RuntimeError) and _TORCH_SHORT_WRITE.search(text)):
        return None
    limit, room = resource.getrlimit(resource.RLIMIT_FSIZE)[0], free() >= needed
    if limit != resource.RLIM_INFINITY and (limit < needed or room):
        return errno.EFBIG, f"{os.strerror(errno.EFBIG)}: the file-size limit (ulimit -f) is {limit:,} bytes"
    if not room:
        return errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (a short write)"
    return errno.EDQUOT, f"{os.strerror(errno.EDQUOT)}? (a short write, with room on the disk and no file-size limit)"


@contextmanager
def disk_full_named(path: str | os.PathLike[str], needed: int, what: str, ways_out: str) -> Iterator[None]:
    """Run the ``with`` block's write of ``path``; a failure for want of room (:func:`disk_full_cause`: an
    ``OSError`` of :data:`DISK_FULL_ERRNOS`, or a library's own error saying so) becomes a :class:`DiskFullError`
    (chained to it) that names ``path``, the ``needed`` bytes, the bytes free now, the cause and ``ways_out``; other
    errors pass unchanged.

    Args:
        needed: the bytes the write needs (a lower bound where the whole is not known: say so in ``what``).
        what: what is written (``"hidden-cache block 3"``).

    Raises:
        DiskFullError: ``"{path}: no room to write {what}: it needs N bytes (G GiB), its file system has F bytes
            (G GiB) free ({cause}); {ways_out}"``.
    """
    def free() -> int:
        return shutil.disk_usage(existing_parent(Path(path).parent)).free

    try:
        yield
    except Exception as e:
        cause = disk_full_cause(e, needed, free)
        if cause is None:
            raise
        free_now = free()
        raise DiskFullError(cause[0], f"{path}: no room to write {what}: it needs {needed:,} bytes "
                            f"({needed / GIB:.2f} GiB), its file system has {free_now:,} bytes ({free_now / GIB:.2f} "
                            f"GiB) free ({cause[1]}); {ways_out}") from e


__all__ = ["DISK_FULL_ERRNOS", "DiskFullError", "DiskSpaceError", "disk_full_cause", "disk_full_named",
           "existing_parent", "require_free"]
