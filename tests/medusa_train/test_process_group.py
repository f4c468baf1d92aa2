"""``trainer.timeout_minutes`` reaches ``TrainingArguments.ddp_timeout`` and the CPU process group, and a rank that
waits past it fails with an error naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from medusa_train.config.schema import LoggerConfig, TrainerConfig
from medusa_train.files.paths import REPO_ROOT
from medusa_train.training.arguments import training_arguments
from medusa_train.training.process_group import explain_timeout, from_main, timeout_seconds
from tests.medusa_train.test_distributed import free_port
from tests.processes import kill_group


def test_the_timeout_reaches_the_training_arguments(tmp_path):
    assert TrainerConfig().timeout_minutes == 60.0  # the default, defined once
    trainer = TrainerConfig(timeout_minutes=2.5, use_cpu=True)
    args = training_arguments(trainer, LoggerConfig(), checkpoints_dir=tmp_path, seed=0, deepspeed_config=None)
    assert args.ddp_timeout == 150
    assert timeout_seconds(0.001) == 1  # never 0 seconds (rounded up)


@pytest.mark.parametrize("value", [0, -1, 7 * 24 * 60 + 1])
def test_a_timeout_out_of_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match="trainer.timeout_minutes"):
        TrainerConfig(timeout_minutes=value).validate()


def test_a_timeout_is_explained_and_other_errors_pass():
    with pytest.raises(TimeoutError, match=r"trainer.timeout_minutes=0.5 .*raise trainer.timeout_minutes") as e:
        with explain_timeout(0.5):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv")
    assert "Timed out waiting 30000ms" in str(e.value)
    with pytest.raises(RuntimeError, match="out of memory"):
        with explain_timeout(0.5):
            raise RuntimeError("CUDA out of memory")


RANK = """
import os, sys, time, torch
from medusa_train.config.schema import LoggerConfig, TrainerConfig
from medusa_train.training.arguments import training_arguments
from medusa_train.training.process_group import explain_timeout
trainer = TrainerConfig(strategy="ddp", use_cpu=True, timeout_minutes=0.05)  # 3 s
args = training_arguments(trainer, LoggerConfig(), checkpoints_dir=sys.argv[1], seed=0, deepspeed_config=None,
                          world_size=2)
args.device  # the Trainer's process group starts here, on the group training_arguments started
assert torch.distributed.is_initialized()
if int(os.environ["RANK"]) == 1:
    time.sleep(7)  # the slow rank: never reaches the barrier in time
    os._exit(0)
start = time.perf_counter()
with explain_timeout(trainer.timeout_minutes):
    try:
        torch.distributed.barrier()
    finally:
        print(f"waited {time.perf_counter() - start:.1f} s", flush=True)
"""


def two_ranks(script: str, folder) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of a two-rank gloo group on this host, each running ``script`` (``folder`` as its argument) in
    its own process group, so :func:`stop_all` reaches what they start."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    return [subprocess.Popen([sys.executable, "-c", script, str(folder)], cwd=REPO_ROOT, text=True,
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True) for r in range(2)]


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            kill_group(p.pid)


@pytest.mark.distributed
@pytest.mark.slow  # two interpreters importing transformers: about 20-40 s on 2 shared cores
def test_a_rank_waiting_past_the_timeout_fails_naming_it(tmp_path):
    started = time.perf_counter()
    procs = two_ranks(RANK, tmp_path)
    try:
        out, err = procs[0].communicate(timeout=120)
        procs[1].communicate(timeout=60)
    finally:
        stop_all(procs)
    assert procs[0].returncode == 1, err[-3000:]
    assert "TimeoutError: rank 0 waited more than trainer.timeout_minutes=0.05 for another rank" in err
    waited = float(out.split("waited ")[1].split()[0])
    assert 2.5 <= waited < 10, out  # the configured 3 s, not torch's 30 minutes
    assert time.perf_counter() - started < 110


def test_from_main_without_a_process_group_is_the_value_itself():
    value = ["medusa_head.0.weight"]
    assert from_main(value) is value


FROM_MAIN = """
import os, sys, torch
from medusa_train.config.schema import LoggerConfig, TrainerConfig
from medusa_train.training.arguments import training_arguments
from medusa_train.training.process_group import from_main
trainer = TrainerConfig(strategy="ddp", use_cpu=True, timeout_minutes=1.0)
training_arguments(trainer, LoggerConfig(), checkpoints_dir=sys.argv[1], seed=0, deepspeed_config=None,
                   world_size=2).device
rank = int(os.environ["RANK"])
print("verdict", from_main(["medusa_head.1.weight"] if rank == 0 else []), flush=True)
"""


@pytest.mark.distributed
@pytest.mark.slow  # two interpreters importing transformers: about 20-40 s on 2 shared cores
def test_every_rank_gets_the_main_process_verdict(tmp_path):
    # the export's finiteness check runs on the main process (the only one holding the gathered weights); the
    # other ranks must stop with it, so its list of non-finite names reaches them
    procs = two_ranks(FROM_MAIN, tmp_path)
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        stop_all(procs)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "verdict ['medusa_head.1.weight']" in out, out
