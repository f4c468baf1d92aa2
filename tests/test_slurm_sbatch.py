"""launch/slurm.sbatch on one machine: its torchrun line run as two groups (``--nnodes=2``, gloo on the CPU) by stub
``srun`` and ``scontrol`` commands, on the tiny model; it trains, is requeued (it adds ``resume=true`` itself) and
continues from the checkpoint, and exports. And its SIGTERM: forwarded to the training step, whose ranks seal a
checkpoint at the end of their step, then the job requeued."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from medusa_train.training import checkpoints
from tests.medusa_train.test_distributed import free_port
from tests.medusa_train.test_training import tiny_overrides, write_tiny_inputs

ROOT = Path(__file__).parents[1]
SBATCH = ROOT / "launch" / "slurm.sbatch"

# srun: the step once per node (SLURM_NNODES), each with its SLURM_NODEID / SLURM_PROCID, SIGTERM passed on to them
SRUN = """#!/usr/bin/env bash
while [[ "$1" == -* ]]; do shift; done
echo "srun $*" >> "$STUB_LOG"
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  while true; do
    wait "$pid"; rc=$?
    kill -0 "$pid" 2>/dev/null || break  # wait was cut short by the trap: wait again
  done
  [[ $rc -ne 0 ]] && status=$rc
done
exit $status
"""
# scontrol: every node of the job is this machine; requeue is recorded
SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$STUB_LOG"
if [[ "$1 $2" == "show hostnames" ]]; then printf 'localhost\\nlocalhost\\n'; fi
"""


def stubs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def sbatch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """What SLURM gives a 2-node job (its id, nodes), the stubs and the venv's torchrun first on PATH."""
    path = f"{stubs(tmp_path / 'bin')}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "STUB_LOG": str(tmp_path / "stub.log"),
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]", "GPUS_PER_NODE": "1",
            "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}


CPU = {"trainer.use_cpu": "true", "trainer.precision": "fp32", "trainer.per_device_train_batch_size": 2}


def sbatch(overrides: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=500)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_torchrun_groups_train_are_requeued_resume_from_the_checkpoint_and_export(tmp_path):
    model_dir, data = write_tiny_inputs(tmp_path)
    out = tmp_path / "run"
    first = sbatch(tiny_overrides(model_dir, data, out, **CPU, **{"trainer.max_steps": 4}), sbatch_env(tmp_path))
    assert first.returncode == 0, first.stderr[-6000:]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-4"]
    log = (tmp_path / "stub.log").read_text()
    assert "--nnodes=2 --nproc_per_node=1 --shutdown_timeout=100 --rdzv_backend=c10d --rdzv_endpoint=localhost:" in log
    assert "--rdzv_id=4242 -m medusa_train.cli.train trainer=ddp" in log
    assert sorted(p.name for p in (out / "hydra").glob("*.log")) == ["train-rank0.log", "train-rank1.log"]
    lock = json.loads((out / "train.lock").read_text()) if (out / "train.lock").exists() else None
    assert lock is None  # released at the end

    # the requeued job: same id, SLURM_RESTART_COUNT=1, the same command line plus a longer run
    again = sbatch(tiny_overrides(model_dir, data, out, **CPU, **{"trainer.max_steps": 8}),
                   sbatch_env(tmp_path, SLURM_RESTART_COUNT="1"))
    assert again.returncode == 0, again.stderr[-6000:]
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-4'}" in (out / "hydra" / "train-rank0.log").read_text()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-8"]
    training = json.loads((out / "export" / "config.json").read_text())["training"]
    assert training["global_step"] == 8 and (out / "export" / "medusa_lm_head.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_is_forwarded_to_the_training_step_and_the_job_requeued(tmp_path):
    model_dir, data = write_tiny_inputs(tmp_path)
    out = tmp_path / "run"
    env = sbatch_env(tmp_path)
    overrides = tiny_overrides(model_dir, data, out, **CPU, **{"trainer.max_steps": 100000})
    proc = subprocess.Popen(["bash", str(SBATCH), *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        # training is under way: any checkpoint (older ones are rotated away, so a given step may never be seen)
        while not any((out / "checkpoints").glob("checkpoint-*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 does before the time limit
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the script, srun, torchrun and the ranks
    assert proc.returncode == 143, err[-4000:]
    assert "SIGTERM (time limit or preemption): stopping the training step" in err
    assert "scontrol requeue 4242" in (tmp_path / "stub.log").read_text()
    # the ranks got the signal through srun and torchrun, finished their step and sealed a checkpoint there
    log = (out / "hydra" / "train-rank0.log").read_text()
    step = int(re.search(r"stopped on a signal after step (\d+)", log).group(1))
    assert step >= 4 and checkpoints.latest_complete(out / "checkpoints").name == f"checkpoint-{step}"
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == []  # no rank of the step is still running
