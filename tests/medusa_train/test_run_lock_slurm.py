"""Under SLURM the run lock's owner is the job: a requeued job (same ``SLURM_JOB_ID``, another host, another pid)
takes over the lock its earlier run left; another job is refused, naming the owner."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys

import pytest

from medusa_train.files.paths import REPO_ROOT
from medusa_train.runs.run_lock import LockHeldError, RunLock
from tests.medusa_train.test_run_safety import ENV, HOLD


def test_a_requeued_job_takes_its_lock_over_on_another_host_and_another_job_is_refused(tmp_path, monkeypatch,
                                                                                        caplog):
    folder, host_a = tmp_path / "run", socket.gethostname()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**ENV, "SLURM_JOB_ID": "123"}, cwd=REPO_ROOT)  # job 123 on host a
    assert holder.stdout.readline().strip() == "held"
    owner = f"pid {holder.pid} on host {host_a} (SLURM job 123)"
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    with pytest.raises(LockHeldError, match=re.escape(f"in use by another run: {owner}")):
        RunLock.acquire(folder)  # the same job id, but its holder is alive: refused
    holder.kill()  # SLURM ends the job's run (preemption, node failure) and requeues it
    holder.wait(timeout=60)
    left = json.loads((folder / "train.lock").read_text())
    assert (left["pid"], left["host"], left["job"]) == (holder.pid, host_a, "123")

    monkeypatch.setattr(socket, "gethostname", lambda: "host-b")  # the requeued run lands on another node
    monkeypatch.setenv("SLURM_JOB_ID", "456")
    with pytest.raises(LockHeldError, match=re.escape(f"holds the lock of a run on another host: {owner}")):
        RunLock.acquire(folder)  # another job: refused as before, the owner named
    assert json.loads((folder / "train.lock").read_text()) == left  # not stolen
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(LockHeldError, match="run on another host"):
        RunLock.acquire(folder)  # outside SLURM: refused as before

    monkeypatch.setenv("SLURM_JOB_ID", "123")
    with caplog.at_level(logging.WARNING, logger="medusa_train.runs.run_lock"):
        lock = RunLock.acquire(folder)
    assert f"SLURM job 123 takes over the lock its earlier run left ({owner}" in caplog.text
    now = json.loads((folder / "train.lock").read_text())
    assert (now["pid"], now["host"], now["job"]) == (os.getpid(), "host-b", "123")
    lock.release()
    assert not (folder / "train.lock").exists()
