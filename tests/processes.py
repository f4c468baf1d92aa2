"""Run a command the way ``subprocess.run(capture_output=True, text=True, timeout=...)`` does, but in a process group
of its own that is killed whole on timeout.

``subprocess.run`` kills only the process it started. For ``python -m torch.distributed.run`` that is the launcher:
its ranks live on, holding a port, the CPU and sometimes a run folder, and slow every test after them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def run_group(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``cmd`` in a new session (its own process group), stdout and stderr captured as text.

    Args:
        cmd: the command and its arguments.
        timeout: seconds before the whole group (launcher and every process it started) is killed with SIGKILL.
        **kwargs: passed to :class:`subprocess.Popen` (``cwd``, ``env``, ...).

    Returns:
        The completed process: ``returncode``, ``stdout``, ``stderr``.

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds, once the group is killed; it carries the output so far.
    """
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
        except BaseException:  # KeyboardInterrupt, a failing fixture: no rank outlives the test
            kill_group(proc.pid)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (gone already: nothing to do)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
