"""One command at a time in a folder: a lock file held for the command's whole life.

Every command that writes into a folder holds that folder's lock while it runs, one lock file per kind of folder:

- ``train.lock`` (:data:`LOCK_FILE`): a training run's ``output_dir`` (``medusa-train``);
- ``eval.lock`` (:data:`EVAL_LOCK`): an evaluation's ``output_dir`` (``medusa-eval``, each job of a sweep);
- ``export.lock`` (:data:`EXPORT_LOCK`): an export folder, held by ``medusa-tune-tree`` (``export_dir``) and by
  :func:`~medusa_train.export.save_export` while it replaces the folder.

A lock file is a JSON record of its holder (pid, host, start time, command line and a random token), protected by a
POSIX record lock (``fcntl.lockf``) on the open file:

- the kernel drops the record lock when the holder dies in any way (``kill -9`` included), so a lock file whose
  record lock is free was left by a run that is gone; on the same host it is taken over, with a warning naming the
  run that left it. One left by another host is refused (that run may still be alive, on a file system whose locks
  do not reach this host); the message tells how to remove it. Under SLURM the owner is the job
  (``SLURM_JOB_ID``, recorded as ``job``): a requeued job keeps its id and takes over the lock its earlier run left,
  on any host and with any pid (SLURM ended that run before requeueing it), while another job's lock is refused as
  above;
- a record lock belongs to a process, not to its forked children (DataLoader workers do not inherit it, and a child
  never releases it), and closing any descriptor of the file drops it: the holder never opens the file again, and a
  second hold of the same lock in one process is refused from a registry instead;
- it is released (the file removed) by :meth:`RunLock.release`, and at interpreter exit for a run that never got
  to its cleanup; a killed run leaves the file behind, for the next run to take over as above;
- on a file system without record locks (some Lustre mounts) the file's existence is the lock (``O_CREAT|O_EXCL``),
  with the holder's pid checked for a left-over file; this is said in a warning.

Under torchrun only the main process takes the lock, before the process group starts. The other ranks write nothing
into ``output_dir`` before the first collective after it starts (the broadcast of the lock's token, which the main
process reaches only while holding the lock), and then check that the lock file they see carries their main
process's token (:func:`check_token`), which also proves that the folder is on a file system every rank shares.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = "train.lock"  # a training run's output_dir
EVAL_LOCK = "eval.lock"  # an evaluation's output_dir
EXPORT_LOCK = "export.lock"  # an export folder (tune-tree, and the export writer while it replaces the folder)
SLURM_JOB_ENV = "SLURM_JOB_ID"  # the same for a job and its requeued runs
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_HELD_HERE: dict[Path, RunLock] = {}  # lock files this process holds


class LockHeldError(RuntimeError):
    """A folder is held by another run (or its lock cannot be taken safely); the message names the holder."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what its lock file records."""

    pid: int
    host: str
    started: str
    command: str
    token: str
    pid_start: int | None = None  # the kernel's start time of ``pid`` (clock ticks since boot), to see pid reuse
    job: str | None = None  # SLURM_JOB_ID: the owner under SLURM, kept by a requeued job on any host

    @classmethod
    def this_process(cls) -> Holder:
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   started=time.strftime("%Y-%m-%d %H:%M:%S %z"),
                   command=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python",
                   token=uuid.uuid4().hex, pid_start=_process_start(os.getpid()),
                   job=os.environ.get(SLURM_JOB_ENV) or None)

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(pid=int(data["pid"]), host=str(data["host"]), started=str(data["started"]),
                       command=str(data.get("command", "")), token=str(data.get("token", "")),
                       pid_start=data.get("pid_start"), job=data.get("job"))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        job = f" (SLURM job {self.job})" if self.job else ""
        return f"pid {self.pid} on host {self.host}{job}, started {self.started} ({self.command})"

    def alive(self) -> bool:
        """Whether the holder still runs (meaningful on its own host only): its pid exists, is not a zombie, and
        started when the holder did (not a reused pid)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            pass
        fields = _proc_stat(self.pid)
        if fields is None:
            return True
        if fields[0] == "Z":  # exited, not yet reaped by its parent
            return False
        return self.pid_start is None or int(fields[19]) == self.pid_start


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def _process_start(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks since boot), None where there is no /proc."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields is not None else None


def lock_path(output_dir: str | os.PathLike[str], name: str = LOCK_FILE) -> Path:
    """The lock file ``name`` (:data:`LOCK_FILE`, :data:`EVAL_LOCK`, :data:`EXPORT_LOCK`) of a folder."""
    return Path(output_dir) / name


def read_holder(output_dir: str | os.PathLike[str], name: str = LOCK_FILE) -> Holder | None:
    """The holder recorded in the folder's lock file ``name``, None when there is none (or it is unreadable).

    Held by this process: the holder from the registry (the file is not opened: closing it would drop the lock).
    """
    path = lock_path(output_dir, name)
    if path.parent.resolve() / name in _HELD_HERE:
        return _HELD_HERE[path.parent.resolve() / name].holder
    try:
        return Holder.parse(path.read_text())
    except OSError:
        return None


def _removal_advice(path: Path, holder: Holder) -> str:
    return (f"if that run is no longer running (check on {holder.host}: `ps -p {holder.pid}`), delete {path} and "
            "start again")


class RunLock:
    """The lock of one folder, held by this process from :meth:`acquire` to :meth:`release`.

    ``field`` is how messages name the folder: the setting that chose it (``output_dir``, ``export_dir``).
    """

    def __init__(self, root: Path, fd: int | None, holder: Holder, path: Path, created_root: bool = False,
                 field: str = "output_dir") -> None:
        self.root = root
        self._fd = fd
        self.holder = holder
        self.path = path
        self.created_root = created_root  # the folder was made for the lock: removed on release if left empty
        self.field = field

    @classmethod
    def acquire(cls, output_dir: str | os.PathLike[str], name: str = LOCK_FILE, field: str = "output_dir") -> RunLock:
        """Take the lock file ``name`` of the folder ``output_dir`` (created if missing), taking over one left by a
        dead run on this host.

        Args:
            output_dir: the folder.
            name: the lock file: :data:`LOCK_FILE` (training), :data:`EVAL_LOCK`, :data:`EXPORT_LOCK`.
            field: the setting that names the folder, for the messages.

        Raises:
            LockHeldError: another live run holds it (pid, host, start time and command named), a run on another
                host left it, or this process already holds it.
        """
        root = Path(output_dir).resolve()
        path = root / name
        if path in _HELD_HERE:
            raise LockHeldError(f"{field} {root} is already held by this process "
                                f"({_HELD_HERE[path].holder.describe()}); one run per {field}")
        created = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        me = Holder.this_process()
        try:
            return cls._acquire(root, path, me, created, field)
        except BaseException:
            if created:
                _remove_if_empty(root)
            raise

    @classmethod
    def _acquire(cls, root: Path, path: Path, me: Holder, created: bool, field: str) -> RunLock:
        for _ in range(20):  # retried only when the file is replaced under us by a releasing holder
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                got = cls._record_lock(fd)
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_LOCKS:
                    raise
                return cls._acquire_without_locks(root, path, me, created, field)
            if not got:
                os.close(fd)
                holder = read_holder(root, path.name)
                if holder is None:  # the holder is writing its record: look again
                    time.sleep(0.05)
                    continue
                gone = holder.host == socket.gethostname() and not holder.alive()
                raise LockHeldError(
                    f"{field} {root} is in use by another run: {holder.describe()}"
                    + ("; that process has exited but one it started still holds the lock (wait for it to end, or "
                       f"find it with `fuser {path}`)" if gone else f"; wait for it to finish or use another {field}")
                )
            if not _same_file(fd, path):  # released and unlinked while we opened it: open the new one
                os.close(fd)
                continue
            try:
                previous = Holder.parse(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
                if previous is not None:
                    cls._check_left_over(path, previous, field)
                _write(fd, me)
            except BaseException:
                os.close(fd)
                raise
            return cls._register(root, fd, me, path, created, field)
        raise LockHeldError(f"could not take the lock {path}: it keeps changing; is another run starting there?")

    @staticmethod
    def _record_lock(fd: int) -> bool:
        import fcntl

        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    @staticmethod
    def _check_left_over(path: Path, previous: Holder, field: str) -> None:
        """A lock file whose record lock was free: take it over from a dead run here, or from an earlier run of this
        SLURM job on any host (a requeue); refuse one from elsewhere."""
        job = os.environ.get(SLURM_JOB_ENV) or None
        here = previous.host == socket.gethostname()
        if job is not None and previous.job == job and not (here and previous.alive()):
            log.warning("%s %s: SLURM job %s takes over the lock its earlier run left (%s): requeued", field,
                        path.parent, job, previous.describe())
            return
        if not here:
            raise LockHeldError(f"{field} {path.parent} holds the lock of a run on another host: "
                                f"{previous.describe()}; {_removal_advice(path, previous)}")
        if previous.alive():  # the kernel says free, the process runs: do not guess
            raise LockHeldError(f"{field} {path.parent} is in use by another run: {previous.describe()}")
        log.warning("%s %s: taking over the lock left by %s, which is no longer running", field, path.parent,
                    previous.describe())

    @classmethod
    def _acquire_without_locks(cls, root: Path, path: Path, me: Holder, created: bool, field: str) -> RunLock:
        log.warning("the file system of %s has no file locks: %s is held by its existence alone (remove it by hand "
                    "if a run on another host left it)", root, path)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                previous = read_holder(root, path.name)
                if previous is None:
                    raise LockHeldError(f"{field} {root} holds an unreadable lock file {path}; if no run uses the "
                                        "folder, delete it") from None
                cls._check_left_over(path, previous, field)  # raises for a live holder or one on another host
                path.unlink(missing_ok=True)
                continue
            _write(fd, me)
            return cls._register(root, fd, me, path, created, field)
        raise LockHeldError(f"could not take the lock {path}: another run took it first")

    @classmethod
    def _register(cls, root: Path, fd: int, me: Holder, path: Path, created: bool, field: str) -> RunLock:
        lock = cls(root, fd, me, path, created, field)
        _HELD_HERE[path] = lock
        atexit.register(lock.release)  # a run that never reached its cleanup still leaves no lock file
        log.info("holding %s %s (%s)", field, root, path.name)
        return lock

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent); remove the folder itself if it was created for the
        lock and nothing else was written into it. A lock file no longer at its path (the folder was replaced whole,
        as :func:`~medusa_train.export.save_export` does) is left to whoever holds the path now."""
        if self._fd is None or os.getpid() != self.holder.pid:  # a forked child never releases its parent's lock
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # drops the record lock
            self._fd = None
            _HELD_HERE.pop(self.path, None)
            atexit.unregister(self.release)
        if self.created_root:
            _remove_if_empty(self.root)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty (the run wrote into it), or gone
        pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _write(fd: int, holder: Holder) -> None:
    data = (json.dumps(asdict(holder), indent=1) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def check_token(output_dir: str | os.PathLike[str], token: str, name: str = LOCK_FILE) -> None:
    """Non-main ranks: the lock file of ``output_dir`` is the one their main process took (same ``token``).

    Raises:
        LockHeldError: no lock file, or another run's: ``output_dir`` is not on a file system all ranks share, or
            the folder changed hands.
    """
    holder = read_holder(output_dir, name)
    if holder is None or holder.token != token:
        seen = "no lock file" if holder is None else f"the lock of {holder.describe()}"
        raise LockHeldError(f"output_dir {Path(output_dir).resolve()}: this rank sees {seen}, not the lock its main "
                            "process holds; output_dir must be on a file system every rank shares")
