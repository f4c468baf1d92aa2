"""tests/processes.py: a command's whole process group is killed on timeout, not only the process it started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.processes import run_group

# A launcher that starts a child ("a rank") which would outlive it, writes the child's pid and waits.
LAUNCHER = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); print(child.pid, flush=True); time.sleep(120)")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waits only for its parent to read it
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow  # waits out a 10 s timeout
def test_on_timeout_the_launcher_and_its_children_are_killed():
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_group([sys.executable, "-c", LAUNCHER], timeout=10)
    child = int(caught.value.output.split()[0])
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def test_a_finished_command_returns_its_code_and_output():
    result = run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                       timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
