"""Preemption: SIGTERM (or SIGUSR1) during training seals a checkpoint at the end of that step and exits with the
requeue code; the run resumed from it exports the same heads, byte for byte (fp32, one process), as one never stopped.
Two ranks agree on the step even when only one of them got the signal."""

from __future__ import annotations

import hashlib
import os
import sys
import time

import pytest

from medusa_train.files.paths import REPO_ROOT
from medusa_train.training import checkpoints
from medusa_train.runs.drills import EXIT_AFTER_STEP, EXIT_CODE, SIGNAL_AT_STEP
from medusa_train.training.callbacks import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    exit_callback_from_env,
    signal_callback_from_env,
)
from medusa_train.training.recipe import build_recipe
from tests.processes import run_group
from tests.medusa_train.test_distributed import check_ok, free_port
from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

NO_PERIODIC_SAVE = {"trainer.save_steps": 100, "trainer.precision": "fp32"}  # the only checkpoint: the signal's


def export_digests(run) -> dict[str, str]:
    export = run / "export"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(export.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    model_dir, data = write_tiny_inputs(root)
    whole = root / "whole"
    build_recipe(compose_train(tiny_overrides(model_dir, data, whole, **NO_PERIODIC_SAVE))).run()
    return model_dir, data, export_digests(whole)


def test_sigterm_seals_a_checkpoint_and_the_resumed_run_exports_identical_heads(inputs, tmp_path, monkeypatch):
    model_dir, data, whole = inputs
    run = tmp_path / "run"
    monkeypatch.setenv(SIGNAL_AT_STEP, "3")
    with pytest.raises(Preempted) as stopped:
        build_recipe(compose_train(tiny_overrides(model_dir, data, run, **NO_PERIODIC_SAVE))).run()
    assert stopped.value.code == PREEMPTED_EXIT_CODE and stopped.value.step == 3
    assert checkpoints.latest_complete(run / "checkpoints").name == "checkpoint-3"  # sealed, off the save schedule
    assert not (run / "export").exists()  # a stopped run exports nothing
    monkeypatch.delenv(SIGNAL_AT_STEP)
    build_recipe(compose_train(tiny_overrides(model_dir, data, run, resume="true", **NO_PERIODIC_SAVE))).run()
    assert len(whole) >= 1 and export_digests(run) == whole


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_stop_at_the_same_step_when_one_is_signalled(inputs, tmp_path):
    model_dir, data, _ = inputs
    run = tmp_path / "run"
    overrides = ["trainer=ddp", *tiny_overrides(model_dir, data, run, **{**NO_PERIODIC_SAVE,
                                                                   "trainer.per_device_train_batch_size": 2})]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "medusa_train.cli.train", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", SIGNAL_AT_STEP: "4:1"}  # rank 1 only
    result = run_group(cmd, cwd=REPO_ROOT, env=env, timeout=400)
    assert result.returncode != 0 and f"exitcode  : {PREEMPTED_EXIT_CODE}" in result.stderr, result.stderr[-3000:]
    assert checkpoints.latest_complete(run / "checkpoints").name == "checkpoint-4"
    env.pop(SIGNAL_AT_STEP)
    check_ok(run_group([*cmd[:4], f"--master_port={free_port()}", *cmd[5:], "resume=true"], cwd=REPO_ROOT,
                       env=env, timeout=400))
    assert (run / "export").is_dir()


def test_a_single_process_run_exits_with_the_requeue_code(inputs, tmp_path):
    model_dir, data, _ = inputs
    cmd = [sys.executable, "-m", "medusa_train.cli.train",
           *tiny_overrides(model_dir, data, tmp_path / "run", **NO_PERIODIC_SAVE)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), SIGNAL_AT_STEP: "2"}
    result = run_group(cmd, cwd=REPO_ROOT, env=env, timeout=300)
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr[-3000:]
    assert checkpoints.latest_complete(tmp_path / "run" / "checkpoints").name == "checkpoint-2"


@pytest.mark.parametrize("value", ["0", "x", "3:a", "-1"])
@pytest.mark.parametrize("name,parse", [(SIGNAL_AT_STEP, signal_callback_from_env),
                                        (EXIT_AFTER_STEP, exit_callback_from_env)])
def test_a_bad_drill_variable_is_named(name, parse, value, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        parse()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_dying_alone_stops_the_run_at_once_naming_it_and_the_rerun_resumes(inputs, tmp_path):
    model_dir, data, _ = inputs
    run = tmp_path / "run"
    overrides = ["trainer=ddp", *tiny_overrides(model_dir, data, run, **{"trainer.save_steps": 2, "trainer.precision":
                                                                          "fp32", "trainer.per_device_train_batch_size": 2})]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "medusa_train.cli.train"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", EXIT_AFTER_STEP: "3:1"}  # rank 1 dies
    start = time.monotonic()
    result = run_group([*cmd[:3], f"--master_port={free_port()}", *cmd[3:], *overrides], cwd=REPO_ROOT, env=env,
                       timeout=400)
    assert result.returncode != 0 and f"exitcode  : {EXIT_CODE}" in result.stderr, result.stderr[-3000:]
    assert "rank      : 1" in result.stderr  # torchrun names the rank that died first
    assert time.monotonic() - start < 120  # the survivor did not wait out a collective's timeout
    assert checkpoints.latest_complete(run / "checkpoints").name == "checkpoint-2"
    env.pop(EXIT_AFTER_STEP)
    check_ok(run_group([*cmd[:3], f"--master_port={free_port()}", *cmd[3:], *overrides, "resume=true"],
                       cwd=REPO_ROOT, env=env, timeout=400))
    assert (run / "export").is_dir()
