"""Faults at the users' scale on two gloo ranks (torchrun): one rank killed during self-distillation, then during
the hidden-cache build, stops the run at once with torchrun naming it, and each rerun reuses every record and block
sealed before; a run preempted at two ranks on one node resumes as two nodes of one rank under other host names to
heads byte-identical (sha256) to a run never stopped, and a resume on another number of ranks is refused."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from medusa_train.data.self_distill import read_records, written_blocks
from medusa_train.runs.drills import EXIT_AT_CACHE_BLOCK, EXIT_AT_DISTILL_BATCH, EXIT_CODE, SIGNAL_AT_STEP
from medusa_train.files.paths import REPO_ROOT
from medusa_train.training import checkpoints
from medusa_train.training.callbacks import PREEMPTED_EXIT_CODE
from medusa_train.training.recipe import build_recipe
from medusa_train.training.run_dir import OutputDirError
from tests.processes import kill_group, run_group
from tests.medusa_train.test_distributed import check_ok, free_port
from tests.medusa_train.test_preemption import NO_PERIODIC_SAVE, export_digests
from tests.medusa_train.test_training import compose_train, tiny_overrides, write_jsonl, write_tiny_inputs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun(overrides: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``medusa-train`` on two local ranks."""
    return run_group([*TORCHRUN, "--nproc_per_node=2", f"--master_port={free_port()}", "-m",
                      "medusa_train.cli.train", *overrides], cwd=REPO_ROOT, env={**ENV, **(env or {})},
                     timeout=500)


def check_rank_1_died_alone(result: subprocess.CompletedProcess, ended: float) -> None:
    """torchrun named rank 1 and its drill's exit code, and stopped rank 0 at once: well within
    ``trainer.timeout_minutes`` (60), which a rank waiting on a dead one in a collective would have run into."""
    err = result.stderr
    assert result.returncode != 0 and f"exitcode  : {EXIT_CODE}" in err and "rank      : 1" in err, err[-4000:]
    failed_at = datetime.strptime(re.search(r"time      : (\S+)", err).group(1), "%Y-%m-%d_%H:%M:%S").timestamp()
    assert ended - failed_at < 60, f"the run went on {ended - failed_at:.0f} s after rank 1 died"


def distill_records(output: Path) -> dict[str, list[bytes]]:
    """Each block file's whole lines (a last line cut by the kill is dropped by the rerun, and left out here)."""
    return {p.name: [line for line in p.read_bytes().splitlines(keepends=True) if line.endswith(b"\n")]
            for p in written_blocks(output)}


def cache_files(folder: Path) -> dict[str, int]:
    """Every sealed block of the cache (seal present) -> its data file's mtime (ns)."""
    return {p.stem: (folder / f"{p.stem}.safetensors").stat().st_mtime_ns for p in sorted(folder.glob("*.json"))}


def test_a_rank_killed_in_self_distillation_then_in_the_cache_build_stops_the_run_and_each_rerun_reuses_all(
        tmp_path):
    model_dir, _ = write_tiny_inputs(tmp_path)
    n = 1200  # 5 self-distillation blocks of 256 (rank 1: 1 and 3), then 5 train cache blocks (rank 1: 1 and 3)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"conversations": [
        {"from": "human", "value": f"count from {i} to {i + 3 + i % 5}"}, {"from": "gpt", "value": "-"}]}
        for i in range(n)])
    run = tmp_path / "run"
    overrides = ["trainer=ddp", *tiny_overrides(model_dir, data, run, **{
        "data.self_distill": "true", "data.self_distill_engine": "hf", "data.max_new_tokens": 6,
        "data.generation_batch_size": 64, "data.eval_fraction": 0.05, "hidden_cache": "true", "max_length": 32,
        "trainer.per_device_train_batch_size": 2, "trainer.max_steps": 2, "trainer.timeout_minutes": 60})]
    distilled, cache = run / "self_distill" / "conversations.jsonl", run / "hidden_cache"

    # 1. rank 1 dies as its third batch of replies begins: its first two batches are on disk
    result = torchrun(overrides, {EXIT_AT_DISTILL_BATCH: "3:1"})
    check_rank_1_died_alone(result, time.time())
    before = distill_records(distilled)
    rank1 = sum(len(v) for k, v in before.items() if int(k.split("block")[1][:6]) % 2 == 1)
    mine = 2 * 256  # blocks 1 and 3, in batches of even size up to 64 (self_distill)
    assert rank1 == 2 * math.ceil(mine / math.ceil(mine / 64)) and not cache.exists()

    # 2. the rerun keeps every record, generates the others once; rank 1 dies as its second train cache block begins
    result = torchrun(overrides, {EXIT_AT_CACHE_BLOCK: "2:1"})
    check_rank_1_died_alone(result, time.time())
    after = distill_records(distilled)
    assert all(after[name][: len(lines)] == lines for name, lines in before.items())  # nothing rewritten
    ids = [r["id"] for name in after for r in read_records(distilled.parent / name)]
    assert len(ids) == len(set(ids)) == n  # every prompt answered once: the first run's replies reused
    sealed = cache_files(cache)
    assert "train-block-000001" in sealed  # rank 1's first block, sealed before it died

    # 3. the rerun reuses every sealed block (their files untouched), builds the rest and trains
    check_ok(torchrun(overrides))
    assert distill_records(distilled) == after
    now = cache_files(cache)
    assert {k: now[k] for k in sealed} == sealed
    counts = json.loads((run / "export" / "config.json").read_text())["training"]["data"]
    train, held_out = counts["train_conversations"], counts["eval_conversations"]
    assert sorted(now) == [*(f"eval-block-{b:06d}" for b in range(math.ceil(held_out / 256))),
                           *(f"train-block-{b:06d}" for b in range(math.ceil(train / 256)))]
    assert train > 3 * 256


def unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rU", "--uts", "sh", "-c", "hostname node-x"], capture_output=True).returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="needs unshare (a UTS namespace) to give a node another host name")
def test_preempted_on_one_node_resumed_as_two_nodes_on_other_hosts_gives_the_same_heads_and_other_ranks_refused(
        tmp_path):
    model_dir, data = write_tiny_inputs(tmp_path)
    two = {**NO_PERIODIC_SAVE, "trainer.per_device_train_batch_size": 2}

    def overrides(run: Path, **extra: str) -> list[str]:
        return ["trainer=ddp", *tiny_overrides(model_dir, data, run, **two, **extra)]

    whole, run = tmp_path / "whole", tmp_path / "run"
    check_ok(torchrun(overrides(whole)))
    stopped = torchrun(overrides(run), {SIGNAL_AT_STEP: "3", "SLURM_JOB_ID": "77"})
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in stopped.stderr, stopped.stderr[-4000:]
    assert checkpoints.latest_complete(run / "checkpoints").name == "checkpoint-3"

    # one rank cannot continue what two ranks checkpointed (data order, optimizer state): refused, saying so, with
    # the run left as it was
    with pytest.raises(OutputDirError, match=r"the number of ranks \(2 wrote the checkpoints -> 1\)"):
        build_recipe(compose_train(overrides(run, resume="true"))).run()
    assert checkpoints.latest_complete(run / "checkpoints").name == "checkpoint-3"

    # the requeued job on two other hosts, one rank each (torchrun's c10d rendezvous, as launch/slurm.sbatch starts
    # it), same SLURM job id; each node in a process group of its own, so no rank outlives the test
    port = free_port()
    nodes = [subprocess.Popen(
        ["unshare", "-rU", "--uts", "sh", "-c", f'hostname node-{node} && exec "$@"', "sh", *TORCHRUN,
         "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
         "--rdzv_id=77", "--local_addr=127.0.0.1",  # the made-up host names resolve nowhere
         "-m", "medusa_train.cli.train", *overrides(run, resume="true")],
        cwd=REPO_ROOT, env={**ENV, "SLURM_JOB_ID": "77"}, stdout=subprocess.DEVNULL, stderr=(tmp_path / f"node{node}.err")
        .open("w"), text=True, start_new_session=True) for node in range(2)]
    try:
        deadline = time.monotonic() + 500
        while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in nodes):  # one node failed: the other would wait for it
                break
            time.sleep(1)
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_group(p.pid)
                p.wait()
    errors = "\n".join((tmp_path / f"node{node}.err").read_text()[-3000:] for node in range(2))
    assert [p.returncode for p in nodes] == [0, 0], errors
    assert f"resuming from {run / 'checkpoints' / 'checkpoint-3'}" in (run / "hydra" / "train-rank0.log").read_text()
    assert export_digests(run) == export_digests(whole) and len(export_digests(whole)) >= 1

