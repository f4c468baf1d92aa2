"""Two-rank training on the CPU (gloo) through ``python -m torch.distributed.run``: DDP and DeepSpeed ZeRO-2/3 train
the same heads as one process with the same global batch, and a killed run resumes to the same heads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from medusa_train.files.paths import REPO_ROOT
from medusa_train.training import checkpoints
from medusa_train.runs.drills import EXIT_AFTER_STEP, EXIT_CODE
from medusa_train.training.recipe import build_recipe
from tests.processes import run_group
from tests.medusa_train.test_training import (
    assert_same_heads,
    compose_train,
    exported_heads,
    tiny_overrides,
    write_tiny_inputs,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# one process with 4 rows per step == two ranks with 2 rows each (16 training rows: 4 steps an epoch, no remainder)
RANK_BATCH = {"trainer.per_device_train_batch_size": 2, "trainer.precision": "fp32"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(overrides: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``medusa-train`` on 2 local ranks (gloo on the CPU), from the checkout's root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "medusa_train.cli.train", *overrides]
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
                "HF_HUB_OFFLINE": "1", **(env or {})}
    return run_group(cmd, cwd=REPO_ROOT, env=full_env, timeout=400)


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny inputs and the heads one process trains from them (4 rows per step, 8 steps)."""
    root = tmp_path_factory.mktemp("dist")
    model_dir, data = write_tiny_inputs(root)
    build_recipe(compose_train(tiny_overrides(model_dir, data, root / "single"))).run()
    return root, model_dir, data, exported_heads(root / "single" / "export")


def test_ddp_two_ranks_train_the_same_heads_as_one_process(reference):
    root, model_dir, data, single = reference
    out = root / "ddp"
    result = launch(["trainer=ddp", *tiny_overrides(model_dir, data, out, **RANK_BATCH)])
    check_ok(result)
    assert_same_heads(single, exported_heads(out / "export"))
    assert result.stdout.count("per-head accuracy on the eval split") == 1  # rank 0 only
    assert sorted(p.name for p in (out / "hydra").glob("*.log")) == ["train-rank0.log", "train-rank1.log"]
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["checkpoint-4", "checkpoint-8"]
    assert not (out / "train.lock").exists()  # rank 0 held the folder for the run, and released it


def test_deepspeed_zero3_two_ranks_train_the_same_heads_as_one_process(reference):
    """The heads are sharded over the ranks; the export gathers their full fp32 weights."""
    root, model_dir, data, single = reference
    out = root / "zero3"
    check_ok(launch(["trainer=deepspeed_zero3", *tiny_overrides(model_dir, data, out, **RANK_BATCH)]))
    assert_same_heads(single, exported_heads(out / "export"))
    last = out / "checkpoints" / "checkpoint-8"
    assert checkpoints.incomplete_reason(last) is None
    shards = sorted(p.name for p in (last / "global_step8").iterdir())
    assert len([s for s in shards if "optim_states" in s]) == 2  # one optimizer shard per rank


def test_killed_deepspeed_zero2_run_resumes_to_the_same_heads(reference):
    """ZeRO-2 from the hidden-state cache (rank 0 caches the one block of rows, both ranks read it), killed
    after step 5 (its last checkpoint is step 4), then resumed: optimizer, scheduler and data position come back."""
    root, model_dir, data, single = reference
    out = root / "zero2"
    overrides = ["trainer=deepspeed_zero2", *tiny_overrides(model_dir, data, out, hidden_cache="true", **RANK_BATCH)]
    killed = launch(overrides, env={EXIT_AFTER_STEP: "5"})
    assert killed.returncode != 0 and f"exitcode  : {EXIT_CODE}" in killed.stderr
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["checkpoint-4"]
    assert checkpoints.incomplete_reason(out / "checkpoints" / "checkpoint-4") is None
    assert not (out / "export").exists()
    blocks = [p.name for p in (out / "hidden_cache").glob("train-block-*.safetensors")]
    assert blocks == ["train-block-000000.safetensors"]
    resumed = launch([*overrides, "resume=true"])
    check_ok(resumed)
    assert "resuming from" in resumed.stderr + resumed.stdout
    assert "hidden cache: reusing" in resumed.stderr + resumed.stdout
    assert "taking over the lock left by pid" in resumed.stderr + resumed.stdout  # the killed rank 0's
    assert_same_heads(single, exported_heads(out / "export"))


# ---- Hydra heads: the same pipeline with per-head MLPs that read the path's embeddings -------------------------------

HYDRA = {"heads": "hydra", "heads.num_layers": 2}


@pytest.fixture(scope="module")
def hydra_reference(reference):
    root, model_dir, data, _ = reference
    build_recipe(compose_train(tiny_overrides(model_dir, data, root / "hydra_single", **HYDRA))).run()
    return root, model_dir, data, exported_heads(root / "hydra_single" / "export")


def test_ddp_two_ranks_train_the_same_hydra_heads_as_one_process(hydra_reference):
    root, model_dir, data, single = hydra_reference
    out = root / "hydra_ddp"
    check_ok(launch(["trainer=ddp", *tiny_overrides(model_dir, data, out, hidden_cache="true", **HYDRA,
                                                    **RANK_BATCH)]))
    assert "heads.0.residual.weight" in single
    assert_same_heads(single, exported_heads(out / "export"))


def test_deepspeed_zero3_two_ranks_train_the_same_hydra_heads_as_one_process(hydra_reference):
    """Every head's MLP and the stacked projections are sharded over the ranks and gathered at export."""
    root, model_dir, data, single = hydra_reference
    out = root / "hydra_zero3"
    check_ok(launch(["trainer=deepspeed_zero3", *tiny_overrides(model_dir, data, out, **HYDRA, **RANK_BATCH)]))
    assert_same_heads(single, exported_heads(out / "export"))
