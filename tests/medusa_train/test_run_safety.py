"""The run folder is never lost or misdescribed: bad input fails before anything in ``output_dir`` changes, one run
holds a folder at a time, ``resume=true`` refuses what its checkpoints cannot continue, damaged checkpoints and caches
are caught by checksums, and a run that goes non-finite or diverges stops instead of exporting garbage."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from medusa_train.files.paths import REPO_ROOT
from medusa_train.training import checkpoints
from medusa_train.training.recipe import build_recipe
from tests.medusa_train.test_training import (
    assert_same_heads,
    compose_train,
    exported_heads,
    tiny_overrides,
    write_jsonl,
    write_tiny_inputs,
)

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
       "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    return write_tiny_inputs(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def finished_run(inputs, tmp_path_factory) -> Path:
    """A finished tiny run (2 heads, 8 steps, checkpoints 4 and 8, an export); copy it before changing it."""
    model_dir, data = inputs
    out = tmp_path_factory.mktemp("done") / "run"
    build_recipe(compose_train(tiny_overrides(model_dir, data, out))).run()
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


def snapshot(folder: Path, skip_logs: bool = False) -> dict[str, str]:
    """sha256 of every file under ``folder`` by relative path (Hydra's per-rank logs left out with ``skip_logs``)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and not (skip_logs and p.suffix == ".log")}


def cli(overrides: list[str], cwd: Path = REPO_ROOT, **env: str) -> subprocess.CompletedProcess:
    """``medusa-train`` as users run it (Hydra and all), in its own process."""
    return subprocess.run([sys.executable, "-m", "medusa_train.cli.train", *overrides], cwd=cwd, env={**ENV, **env},
                          capture_output=True, text=True, timeout=300)


def blank_records(n: int) -> list[dict]:
    return [{"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": ""}]}] * n


# ---- 1. bad input fails before anything in the folder is deleted or rewritten ------------------------------------

@pytest.mark.parametrize("bad", ["missing data file", "conversations whose turns are all empty"])
def test_overwrite_with_bad_data_fails_before_the_finished_run_is_touched(inputs, run_copy, tmp_path, bad):
    model_dir, _ = inputs
    before = snapshot(run_copy)
    if bad == "missing data file":
        data, error, match = tmp_path / "nope.jsonl", FileNotFoundError, r"data.path: .*nope.jsonl not found"
    else:  # found only after the model loads: the folder must still be as it was
        data, error, match = write_jsonl(tmp_path / "blank.jsonl", blank_records(20)), ValueError, \
            "20 whose turns are all empty"
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, overwrite="true")))
    with pytest.raises(error, match=match):
        recipe.run()
    assert snapshot(run_copy) == before  # export, checkpoints and train_config.yaml intact; no lock left behind


@pytest.mark.slow  # a medusa-train process per call
def test_the_command_line_with_a_missing_data_file_leaves_the_run_folder_as_it_was(inputs, run_copy, tmp_path):
    """Through Hydra too: no copy of the failed config is written into the folder (Hydra's own .hydra/ included)."""
    model_dir, _ = inputs
    before = snapshot(run_copy)
    result = cli(tiny_overrides(model_dir, tmp_path / "nope.jsonl", run_copy, overwrite="true"))
    assert result.returncode == 1 and "data.path: conversation file" in result.stderr
    assert snapshot(run_copy, skip_logs=True) == before


# ---- 2. one run per folder ----------------------------------------------------------------------------------------

HOLD = """
import sys
from medusa_train.runs.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # hold until the test closes stdin
lock.release()
"""


def start_holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=ENV, cwd=REPO_ROOT)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_folder_refuses_a_second_process_naming_the_holder_until_it_is_released(tmp_path):
    from medusa_train.runs.run_lock import LockHeldError, RunLock

    folder = tmp_path / "run"
    holder = start_holder(folder)
    try:
        record = json.loads((folder / "train.lock").read_text())
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        named = f"in use by another run: pid {holder.pid} on host {socket.gethostname()}, started {record['started']}"
        with pytest.raises(LockHeldError, match=re.escape(named)):
            RunLock.acquire(folder)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0 and not (folder / "train.lock").exists()  # released on exit
    with RunLock.acquire(folder):
        with pytest.raises(LockHeldError, match="already held by this process"):
            RunLock.acquire(folder)
    assert not (folder / "train.lock").exists()
    forgot = "import sys\nfrom medusa_train.runs.run_lock import RunLock\nRunLock.acquire(sys.argv[1])\n"
    subprocess.run([sys.executable, "-c", forgot, str(folder)], env=ENV, cwd=REPO_ROOT, check=True, timeout=120)
    assert not (folder / "train.lock").exists()  # released at exit by a process that never called release()


def test_a_lock_left_by_a_killed_process_is_taken_over_and_one_from_another_host_is_not(tmp_path, caplog):
    from medusa_train.runs.run_lock import LockHeldError, RunLock

    folder = tmp_path / "run"
    holder = start_holder(folder)
    holder.kill()  # SIGKILL: no cleanup, the lock file stays
    holder.wait(timeout=60)
    assert json.loads((folder / "train.lock").read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="medusa_train.runs.run_lock"):
        lock = RunLock.acquire(folder)
    assert f"taking over the lock left by pid {holder.pid}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((folder / "train.lock").read_text())["pid"] == os.getpid()
    lock.release()
    other = {"pid": 4242, "host": "another-host", "started": "2026-01-01 00:00:00 +0000", "command": "medusa-train",
             "token": "t"}
    (folder / "train.lock").write_text(json.dumps(other))
    with pytest.raises(LockHeldError, match=rf"run on another host: pid 4242 on host another-host.*delete "
                                            rf"{folder / 'train.lock'}"):
        RunLock.acquire(folder)
    assert json.loads((folder / "train.lock").read_text()) == other  # not stolen


def test_without_file_locks_the_lock_file_itself_is_the_lock(tmp_path, monkeypatch, caplog):
    """Some file systems (Lustre without flock) refuse record locks: the file's existence and its pid decide."""
    import errno

    from medusa_train.runs.run_lock import LockHeldError, RunLock

    def no_locks(fd):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(RunLock, "_record_lock", staticmethod(no_locks))
    folder = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        for pid in (live.pid, dead.pid):
            folder.mkdir(exist_ok=True)
            (folder / "train.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                           "started": "then", "command": "medusa-train"}))
            if pid == live.pid:
                with pytest.raises(LockHeldError, match=f"in use by another run: pid {pid} on host"):
                    RunLock.acquire(folder)
                continue
            with caplog.at_level(logging.WARNING, logger="medusa_train.runs.run_lock"):
                lock = RunLock.acquire(folder)
            assert "has no file locks" in caplog.text and f"taking over the lock left by pid {pid}" in caplog.text
            assert json.loads((folder / "train.lock").read_text())["pid"] == os.getpid()
            lock.release()
            assert not (folder / "train.lock").exists()
    finally:
        live.kill()
        live.wait()


class PauseAtSave(TrainerCallback):
    """Signal readiness after the first checkpoint and wait (to be refused against, then killed)."""

    def __init__(self, ready: Path) -> None:
        self.ready = ready

    def on_save(self, args, state, control, **kwargs):
        self.ready.write_text(str(state.global_step))
        time.sleep(600)


TRAIN_AND_PAUSE = """
import sys
from pathlib import Path
from medusa_train.training.recipe import build_recipe
from tests.medusa_train.test_training import compose_train, tiny_overrides
from tests.medusa_train.test_run_safety import PauseAtSave
model_dir, data, out, ready = map(Path, sys.argv[1:5])
build_recipe(compose_train(tiny_overrides(model_dir, data, out)), callbacks=[PauseAtSave(ready)]).run()
"""


@pytest.mark.slow
def test_two_training_runs_into_one_folder_the_second_is_refused_and_resumes_after_a_kill(inputs, tmp_path):
    model_dir, data = inputs
    out, ready = tmp_path / "run", tmp_path / "ready"
    first = subprocess.Popen([sys.executable, "-c", TRAIN_AND_PAUSE, str(model_dir), str(data), str(out), str(ready)],
                             env=ENV, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first run never reached its checkpoint"
            time.sleep(0.2)
        before = snapshot(out)
        second = cli(tiny_overrides(model_dir, data, out))  # the very same command
        assert second.returncode == 1
        assert f"is in use by another run: pid {first.pid} on host {socket.gethostname()}, started" in second.stderr
        assert snapshot(out, skip_logs=True) == before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    resumed = cli(tiny_overrides(model_dir, data, out, resume="true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"taking over the lock left by pid {first.pid}" in said
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-4'}" in said
    assert (out / "export" / "medusa_lm_head.safetensors").is_file() and not (out / "train.lock").exists()


# ---- 3. resume refuses what its checkpoints cannot continue, before anything is written ---------------------------

def test_resume_with_another_head_count_is_refused_before_the_model_loads_and_the_advice_works(inputs, run_copy):
    model_dir, data = inputs
    before = snapshot(run_copy)
    three = {"heads.num_heads": 3}
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, resume="true", **three)))
    with pytest.raises(ValueError, match=r"resume=true cannot continue the run .* heads.num_heads \(2 -> 3\).*"
                                         r"new output_dir, or overwrite=true"):
        recipe.setup()
    recipe.cleanup(failed=True)
    assert not hasattr(recipe, "base")  # refused before the model loaded
    assert snapshot(run_copy) == before  # train_config.yaml still says 2 heads
    with pytest.raises(ValueError, match="heads.num_heads") as refused:
        build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, **three))).check()
    assert "resume=true to continue" not in str(refused.value)  # it would not work: not advised
    # what resume=true may change, it continues: the refusal advises it, and it trains on from the last checkpoint
    longer = {"trainer.max_steps": 12}
    with pytest.raises(ValueError, match=r"trainer.max_steps \(8 -> 12\)\. Use resume=true to continue"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, **longer))).check()
    resumed = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, resume="true", **longer)))
    resumed.run()
    assert resumed.summary["resumed_from"] == str(run_copy / "checkpoints" / "checkpoint-8")
    assert resumed.summary["global_step"] == 12


def test_resume_on_another_number_of_ranks_is_refused(inputs, run_copy):
    model_dir, data = inputs
    marker = run_copy / "checkpoints" / "checkpoint-8" / checkpoints.COMPLETE_MARKER
    assert json.loads(marker.read_text())["world_size"] == 1
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "world_size": 2}))  # as if 2 ranks wrote it
    with pytest.raises(ValueError, match=r"resume=true cannot continue .* the number of ranks \(2 wrote the "
                                         r"checkpoints -> 1\)"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, resume="true"))).check()
    with pytest.raises(ValueError, match=r"already holds .* Use a new output_dir, or overwrite=true") as refused:
        build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy))).check()
    assert "resume=true to continue" not in str(refused.value)


# ---- 4. checksums, and training that stops instead of going non-finite --------------------------------------------

def damage(path: Path) -> None:
    """Overwrite the last 64 bytes with 0xFF (NaN as fp32), keeping the size."""
    data = bytearray(path.read_bytes())
    data[-64:] = b"\xff" * 64
    path.write_bytes(bytes(data))


def test_checkpoint_checksums_catch_damage_that_keeps_the_size(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        folder = root / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
        checkpoints.mark_complete(folder, step)
    damage(root / "checkpoint-4" / "model.safetensors")
    assert checkpoints.incomplete_reason(root / "checkpoint-4") is None  # the size alone cannot tell
    assert "model.safetensors is damaged" in checkpoints.incomplete_reason(root / "checkpoint-4", verify=True)
    assert checkpoints.remove_incomplete(root, verify_latest=True) == [root / "checkpoint-4"]
    assert checkpoints.latest_complete(root) == root / "checkpoint-2"


def test_a_damaged_newest_checkpoint_is_skipped_and_resume_reaches_the_same_heads(inputs, run_copy, caplog):
    model_dir, data = inputs
    whole = exported_heads(run_copy / "export")
    damage(run_copy / "checkpoints" / "checkpoint-8" / "model.safetensors")
    resumed = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, resume="true")))
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.checkpoints"):
        resumed.run()
    assert "checkpoint-8: model.safetensors is damaged" in caplog.text
    assert "the previous complete checkpoint is used instead" in caplog.text
    assert resumed.summary["resumed_from"] == str(run_copy / "checkpoints" / "checkpoint-4")
    assert_same_heads(whole, exported_heads(run_copy / "export"))


class PoisonAt(TrainerCallback):
    """Write a NaN into a head weight at the end of optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                model.block_weight.view(-1)[0] = float("nan")


@pytest.mark.parametrize("poison_step, stop", [(10, r"step 11: the loss is nan"),
                                               (12, r"step 12: trainable weights are not finite \(block_weight\); "
                                                    r"this checkpoint was not written")])
def test_a_nan_stops_training_with_the_step_and_keeps_the_good_export(inputs, run_copy, poison_step, stop):
    model_dir, data = inputs
    export_before = snapshot(run_copy / "export")
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, resume="true",
                                                      **{"trainer.max_steps": 16})), callbacks=[PoisonAt(poison_step)])
    with pytest.raises(RuntimeError, match=rf"training stopped at {stop}.*trainer.learning_rate"):  # TrainingStopped
        recipe.run()
    assert snapshot(run_copy / "export") == export_before
    assert [p.name for p in sorted((run_copy / "checkpoints").iterdir())] == ["checkpoint-4", "checkpoint-8"]


def test_an_absurd_learning_rate_stops_with_the_step_instead_of_training_to_huge_losses(inputs, tmp_path):
    model_dir, data = inputs
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", **{
        "trainer.learning_rate": 1e6, "trainer.max_steps": 30})))
    with pytest.raises(RuntimeError, match=r"training stopped at step \d+: head \d's mean loss .* over 10 x "
                                              r"ln\(512\) = 62.4 .*diverged.*trainer.learning_rate \(now 1e\+06"):
        recipe.run()
    assert not (tmp_path / "run" / "export").exists()


def test_a_damaged_hidden_cache_shard_is_rebuilt(inputs, tmp_path, caplog):
    model_dir, data = inputs
    overrides = tiny_overrides(model_dir, data, tmp_path / "run", hidden_cache="true", overwrite="true",
                               **{"heads.target": "base_argmax", "trainer.max_steps": 2})
    build_recipe(compose_train(overrides)).run()
    shard = tmp_path / "run" / "hidden_cache" / "train-block-000000.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[:-64])  # cut short (same-size damage: verify=True, see test_hidden_cache_stream)
    with caplog.at_level(logging.WARNING, logger="medusa_train.training.hidden_cache"):
        build_recipe(compose_train(overrides)).run()
    assert f"{shard} is damaged: {len(original) - 64} bytes" in caplog.text and "rebuilding it" in caplog.text
    assert shard.read_bytes() == original


def test_the_hidden_cache_follows_the_base_weights_not_their_path(inputs, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    model_dir, data = inputs
    cache = tmp_path / "cache"
    shard = cache / "train-block-000000.safetensors"

    def run(base: Path, name: str) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="medusa_train.training.hidden_cache"):
            build_recipe(compose_train(tiny_overrides(base, data, tmp_path / name, hidden_cache="true",
                                                      hidden_cache_dir=str(cache), **{"heads.target": "base_argmax",
                                                                                      "trainer.max_steps": 2}))).run()
        return caplog.text

    assert f"hidden cache: wrote {shard}" in run(model_dir, "first")
    moved = tmp_path / "moved_llama"
    shutil.copytree(model_dir, moved)  # the same weights elsewhere (a moved checkout, another venv)
    assert f"hidden cache: reusing {shard}" in run(moved, "second")
    changed = AutoModelForCausalLM.from_pretrained(moved)
    with torch.no_grad():
        changed.model.norm.weight.mul_(1.5)  # the final norm: every hidden state differs
    changed.save_pretrained(moved)  # retrained in place: same path, other hidden states
    text = run(moved, "third")
    assert (f"hidden cache: rebuilding {shard} (built for other data (another dataset, base model or dtype))"
            in text and f"hidden cache: wrote {shard}" in text)


# ---- 5. output_dir: never empty, a file, or someone else's folder ---------------------------------------------------

def test_output_dir_rules(tmp_path):
    from medusa_train.training.run_dir import OutputDirError, check_location

    for bad, match in [("", "output_dir is empty"), ("  ", "output_dir is empty")]:
        with pytest.raises(OutputDirError, match=match):
            check_location(bad)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputDirError, match="is a file, not a folder"):
        check_location(tmp_path / "afile")
    with pytest.raises(OutputDirError, match="cannot be created: .*afile is a file"):
        check_location(tmp_path / "afile" / "run")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match=r"holds files that are not a medusa-train run \(notes.txt\).*even with "
                                             "overwrite=true"):
        check_location(tmp_path / "theirs")
    (tmp_path / "empty").mkdir()
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "train_config.yaml").write_text("{}")
    (tmp_path / "ours" / "notes.txt").write_text("a note beside a run is fine")
    for good in ("new", "empty", "ours", "theirs/new"):
        assert check_location(tmp_path / good) == (tmp_path / good).resolve()


@pytest.mark.slow  # a medusa-train process per call
def test_the_command_line_refuses_an_empty_or_foreign_output_dir_before_hydra_writes(inputs, tmp_path):
    model_dir, data = inputs
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    root_hydra = Path("/hydra").exists()
    overrides = [o for o in tiny_overrides(model_dir, data, tmp_path / "unused") if not o.startswith("output_dir=")]
    empty = cli([*overrides, "output_dir="], cwd=cwd)
    assert empty.returncode == 2 and "medusa-train: output_dir is empty" in empty.stderr
    assert list(cwd.iterdir()) == [] and Path("/hydra").exists() == root_hydra  # nothing in . or in /hydra
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    refused = cli(tiny_overrides(model_dir, data, theirs, overwrite="true"), cwd=cwd)
    assert refused.returncode == 2 and "holds files that are not a medusa-train run (notes.txt)" in refused.stderr
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def symlink_loop(folder: Path) -> Path:
    """``folder/a -> b`` and ``folder/b -> a``: a path through ``a`` can never be resolved."""
    folder.mkdir()
    (folder / "a").symlink_to("b")
    (folder / "b").symlink_to("a")
    return folder / "a"


def test_a_folder_in_a_symlink_loop_is_named_as_such_by_each_command_check(tmp_path):
    """medusa-train's and medusa-eval's output_dir and the export_dir of tune-tree, generate and export-gguf: one
    message naming the path, "symlink loop" and the links, never Python's RuntimeError or an OSError."""
    from inference.evaluation.eval_folder import EvalDirError, check_eval_dir
    from medusa_train.export.files import check_export_dir, check_readable
    from medusa_train.training.run_dir import OutputDirError, check_location

    loop = symlink_loop(tmp_path / "loop")
    links = (rf"symlink loop \({loop} -> b -> a\): a symbolic link on the path leads back to itself; fix or remove the "
             "link")
    with pytest.raises(OutputDirError, match=rf"^output_dir {loop}/run: {links}, or choose another output_dir$"):
        check_location(loop / "run")
    with pytest.raises(EvalDirError, match=rf"^output_dir {loop}/eval: {links}, or choose another output_dir$"):
        check_eval_dir(loop / "eval")
    for check in (check_export_dir, check_readable):
        with pytest.raises(ValueError, match=rf"^export_dir {loop}: {links}, or choose another export_dir$"):
            check(loop)
    assert sorted(p.name for p in loop.parent.iterdir()) == ["a", "b"]


@pytest.mark.slow  # a medusa-train process
def test_medusa_train_refuses_an_output_dir_in_a_symlink_loop_in_one_line_with_exit_2(inputs, tmp_path):
    model_dir, data = inputs
    loop = symlink_loop(tmp_path / "loop")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    run = cli(tiny_overrides(model_dir, data, loop / "run"), cwd=cwd)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr == (f"medusa-train: output_dir {loop}/run: symlink loop ({loop} -> b -> a): a symbolic link on "
                          "the path leads back to itself; fix or remove the link, or choose another output_dir\n")
    assert sorted(p.name for p in loop.parent.iterdir()) == ["a", "b"] and list(cwd.iterdir()) == []


# ---- 6. too little data is refused before training, saying what was dropped ----------------------------------------

def test_too_little_data_is_refused_before_training_with_what_was_dropped(inputs, tmp_path):
    model_dir, _ = inputs
    # 20 copies of one conversation with an empty reply: 19 are duplicates, one row with one labelled token is left
    empty_replies = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}] * 20
    data = write_jsonl(tmp_path / "thin.jsonl", empty_replies + blank_records(3))
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", **{"data.eval_fraction": 0})))
    with pytest.raises(ValueError, match=r"too little data to train on: 1 training conversations with 1 labelled "
                                         r"tokens .*one optimizer step takes 4 \(trainer.per_device_train_batch_size=4 "
                                         r".*3 whose turns are all empty.*duplicate=19"):
        recipe.setup()
    recipe.cleanup(failed=True)
    assert recipe.trainer is None and not (tmp_path / "run").exists()  # the folder made for the lock is gone
