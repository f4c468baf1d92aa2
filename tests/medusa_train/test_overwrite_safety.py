"""``overwrite=true`` never costs what it should not: a folder that is not proven to be one of our runs is refused
(nothing in it written, moved or deleted), and an old run is only set aside until the new run has its first complete
checkpoint: a new run that fails, is interrupted or killed before that leaves the old run as it was, byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import TrainerCallback

from medusa_train.files.paths import REPO_ROOT
from medusa_train.training import checkpoints, run_dir
from medusa_train.training.recipe import build_recipe
from medusa_train.training.run_dir import OutputDirError, RunPaths
from medusa_train.training.trainer import DrafterTrainer
from tests.medusa_train.test_run_safety import (  # noqa: F401 (the fixtures: a tiny model, a finished run, a copy)
    ENV,
    finished_run,
    inputs,
    run_copy,
    snapshot,
)
from tests.medusa_train.test_training import compose_train, tiny_overrides

SET_ASIDE = (run_dir.ASIDE, run_dir.MOVING, run_dir.DELETING)


# ---- a folder is ours only when our run record proves it ----------------------------------------------------------

USERS_FOLDERS = {
    "a project's checkpoint and ONNX export": {"checkpoints/best_model.ckpt": b"weights", "export/model.onnx": b"onnx"},
    "another trainer's checkpoint-N folder": {"checkpoints/checkpoint-100/pytorch_model.bin": b"weights"},
    "another tool's train_config.yaml": {"train_config.yaml": b"lr: 0.1\nepochs: 3\n",
                                         "checkpoints/best_model.ckpt": b"weights"},
}


@pytest.mark.parametrize("start", ["overwrite", "resume"])
@pytest.mark.parametrize("kind", sorted(USERS_FOLDERS))
def test_a_users_folder_with_checkpoints_or_an_export_is_refused_even_with_overwrite(inputs, tmp_path, kind, start):
    model_dir, data = inputs
    project = tmp_path / "project"
    for name, content in USERS_FOLDERS[kind].items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_bytes(content)
    before = snapshot(project)
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, project, **{start: "true"})))
    found = {"a project's checkpoint and ONNX export": r"checkpoints/ \(best_model.ckpt\), export/ \(model.onnx\)",
             "another trainer's checkpoint-N folder": r"checkpoints/ \(checkpoint-100/pytorch_model.bin\)",
             "another tool's train_config.yaml": r"checkpoints/ \(best_model.ckpt\), train_config.yaml"}[kind]
    record = ("its train_config.yaml is not a medusa-train run record" if "train_config" in kind
              else "there is no train_config.yaml")
    with pytest.raises(OutputDirError, match=rf"output_dir {project} holds {found} but {record}.*never writes into, "
                                             r"moves or deletes them, even with overwrite=true.*choose another "
                                             r"output_dir"):
        recipe.run()
    assert not hasattr(recipe, "base")  # refused before the model loaded
    assert snapshot(project) == before  # every file as it was, nothing added (no lock, no train_config.yaml)


def test_the_command_line_check_refuses_a_users_folder_before_hydra_writes_into_it(inputs, tmp_path, capsys):
    """The same rule is what ``medusa-train``'s Hydra callback runs before Hydra makes ``${output_dir}/hydra``: one
    line on stderr, exit status 2."""
    import re

    from medusa_train.cli.train import CheckOutputDir

    model_dir, data = inputs
    project = tmp_path / "project"
    (project / "export").mkdir(parents=True)
    (project / "export" / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(SystemExit) as exit_:
        CheckOutputDir().on_run_start(compose_train(tiny_overrides(model_dir, data, project, overwrite="true")))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert re.match(r"medusa-train: output_dir .*project holds export/ \(model.onnx\) but there is no "
                    "train_config.yaml", err), err
    assert [p.name for p in project.iterdir()] == ["export"]


# ---- an overwritten run is set aside, and deleted only once the new run has a complete checkpoint -------------------

class FailAt(TrainerCallback):
    """Raise ``error`` at the end of optimizer step ``step`` (before the first checkpoint, at step 4), recording
    what the folder held then."""

    def __init__(self, root: Path, step: int, error: BaseException) -> None:
        self.root, self.step, self.error = root, step, error
        self.seen: list[str] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.seen = sorted(p.name for p in self.root.iterdir())
            raise self.error


def fail_creating_the_optimizer(monkeypatch) -> None:
    """What torch says of trainer.adam_beta1=1.5 when the optimizer is built, after the folder was prepared (a
    failure no check before it catches)."""

    def refuse(self, *args, **kwargs):
        raise ValueError("Invalid beta parameter at index 0: 1.5")

    monkeypatch.setattr(DrafterTrainer, "create_optimizer", refuse)


@pytest.mark.parametrize("failure", ["optimizer", "exception at step 2", "Ctrl-C at step 2"])
def test_an_overwrite_that_fails_before_its_first_checkpoint_leaves_the_old_run_intact(inputs, run_copy, monkeypatch,
                                                                                      failure):
    model_dir, data = inputs
    before = snapshot(run_copy)
    callbacks = []
    if failure == "optimizer":
        fail_creating_the_optimizer(monkeypatch)
        error, match = ValueError, "Invalid beta parameter"
    else:
        error = RuntimeError if failure.startswith("exception") else KeyboardInterrupt
        callbacks = [FailAt(run_copy, 2, error("stopped at step 2"))]
        match = "stopped at step 2"
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, overwrite="true", seed=7)),
                          callbacks=callbacks)
    with pytest.raises(error, match=match):
        recipe.run()
    if callbacks:  # while the new run trained, the old one was aside, not deleted
        assert ".overwritten" in callbacks[0].seen and "export" not in callbacks[0].seen
    assert snapshot(run_copy) == before  # old export, checkpoints and train_config.yaml byte for byte; no lock


def test_a_successful_overwrite_deletes_the_old_run_once_the_new_checkpoint_is_sealed(inputs, run_copy):
    model_dir, data = inputs
    old = snapshot(run_copy)

    class Watch(TrainerCallback):
        """What the folder holds after step 1 and at the first checkpoint (the caller's on_save runs after the
        commit)."""

        def __init__(self) -> None:
            self.at: dict[str, list[str]] = {}

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.at["step 1"] = sorted(p.name for p in run_copy.iterdir())
                aside = run_copy / ".overwritten"
                self.at["aside intact"] = [str(snapshot(aside) == old)]

        def on_save(self, args, state, control, **kwargs):
            self.at.setdefault("first save", sorted(p.name for p in run_copy.iterdir()))

    watch = Watch()
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, overwrite="true", seed=7)),
                          callbacks=[watch])
    summary = recipe.run()
    assert summary["global_step"] == 8
    # after step 1: the old run whole in .overwritten/, the new record in its place, no old output left in view
    assert watch.at["step 1"] == [".overwritten", "checkpoints", "train.lock", "train_config.yaml"]
    assert watch.at["aside intact"] == ["True"]
    # at the first checkpoint: the old run is gone
    assert watch.at["first save"] == ["checkpoints", "train.lock", "train_config.yaml"]
    names = sorted(p.name for p in run_copy.iterdir())
    assert names == ["checkpoints", "export", "train_config.yaml"]
    assert run_dir.run_record(run_copy)["seed"] == 7
    assert [p.name for _, p in checkpoints.list_checkpoints(run_copy / "checkpoints")] == ["checkpoint-4",
                                                                                           "checkpoint-8"]
    assert all(checkpoints.incomplete_reason(p) is None for _, p in checkpoints.list_checkpoints(run_copy /
                                                                                               "checkpoints"))
    new = snapshot(run_copy)
    assert new["export/medusa_lm_head.safetensors"] != old["export/medusa_lm_head.safetensors"]  # seed 7's heads
    assert new["train_config.yaml"] != old["train_config.yaml"]


# ---- a run killed at any point leaves a folder the next run settles -----------------------------------------------

class Killed(BaseException):
    """Stands for ``kill -9`` between two renames: nothing after it runs (no restore in a cleanup)."""


def rename_until(monkeypatch, n: int) -> list[int]:
    """Let ``n`` renames through, then raise :class:`Killed` at every later one; returns the count of calls."""
    calls = [0]
    real = run_dir.os.rename

    def rename(src, dst):
        calls[0] += 1
        if calls[0] > n:
            raise Killed(f"killed before rename {calls[0]}")
        real(src, dst)

    monkeypatch.setattr(run_dir.os, "rename", rename)
    return calls


def new_run_until_its_first_checkpoint(paths: RunPaths, sealed: bool) -> None:
    """What a new run writes after prepare: a checkpoint, sealed (complete) or not yet."""
    folder = paths.checkpoints / "checkpoint-2"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"new weights")
    if sealed:
        checkpoints.mark_complete(folder, 2)


@pytest.mark.parametrize("commit", [False, True], ids=["fails before its checkpoint", "reaches its checkpoint"])
def test_a_run_killed_at_any_rename_leaves_either_the_old_run_or_the_new_one(finished_run, tmp_path, monkeypatch,
                                                                            commit):
    """Every point of set-aside, restore (a failed run's) and commit: the next run's settling (after taking the lock)
    gives back the old run, file for file, or (once the commit's rename happened) the new run alone."""
    old = snapshot(finished_run)
    resolved = {**run_dir.run_record(finished_run), "seed": 7}
    outcomes = set()
    for n in range(40):
        root = tmp_path / f"run{n}"
        shutil.copytree(finished_run, root)
        paths = RunPaths(root)
        calls = rename_until(monkeypatch, n)
        try:
            run_dir.prepare_output_dir(paths, resolved, overwrite=True)
            new_run_until_its_first_checkpoint(paths, sealed=commit)
            if commit:
                run_dir.discard_overwritten(paths)
            else:
                run_dir.settle_overwritten(paths)  # what the failed run's release does
            done = True
        except Killed:
            done = False
        monkeypatch.undo()
        run_dir.settle_overwritten(paths)  # the next run, right after taking the lock
        settled = snapshot(root)
        assert not any((root / name).exists() for name in SET_ASIDE)
        if settled == old:
            outcomes.add("old")
        else:
            assert commit, f"killed after {n} renames: the old run was not restored"
            assert sorted(settled) == ["checkpoints/checkpoint-2/medusa_checkpoint_complete.json",
                                       "checkpoints/checkpoint-2/model.safetensors", "train_config.yaml"]
            assert run_dir.run_record(root)["seed"] == 7
            outcomes.add("new")
        if done:
            assert calls[0] == n, "the whole sequence ran"
            break
    else:
        pytest.fail("the sequence never completed")
    assert outcomes == ({"old", "new"} if commit else {"old"})
    assert n >= 4  # set-aside alone takes 4 renames (3 entries, then the folder)


EXIT_AT_STEP_2 = """
import sys
from pathlib import Path
from medusa_train.training.recipe import build_recipe
from tests.medusa_train.test_training import compose_train, tiny_overrides
model_dir, data, out = map(Path, sys.argv[1:4])
build_recipe(compose_train(tiny_overrides(model_dir, data, out, overwrite="true", seed=7))).run()
"""


@pytest.mark.slow  # a training process
def test_a_process_killed_mid_overwrite_leaves_the_old_run_for_the_next_run_to_restore(inputs, run_copy):
    model_dir, data = inputs
    before = snapshot(run_copy)
    killed = subprocess.run([sys.executable, "-c", EXIT_AT_STEP_2, str(model_dir), str(data), str(run_copy)],
                            env={**ENV, "MEDUSA_TRAIN_EXIT_AFTER_STEP": "2"}, cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == 17, killed.stderr[-3000:]  # os._exit: no cleanup ran
    assert (run_copy / ".overwritten" / "export").is_dir() and not (run_copy / "export").exists()
    assert json.loads((run_copy / "train.lock").read_text())["pid"] != os.getpid()  # the killed run's lock
    nxt = build_recipe(compose_train(tiny_overrides(model_dir, data, run_copy, resume="true")))
    nxt.hold()  # takes over the killed run's lock, restores, and checks resume=true against the old run
    nxt.release()
    assert snapshot(run_copy) == before
