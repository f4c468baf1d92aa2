"""medusa-eval writes only into a folder that is new, empty or one of its runs, and one run at a time: a folder of
someone else's files is refused before any model loads and left byte-identical, and a second run into a folder is
refused while the first holds it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas
from inference.evaluation.eval_folder import EvalDirError, check_eval_dir
from inference.conf import CONF_DIR
from medusa_train.runs.run_lock import EVAL_LOCK, LockHeldError
from tests.inference.test_tune_lock import start_holder

register_schemas()


def eval_config(out: Path, *extra: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=[f"export_dir={out.parent / 'export'}", f"output_dir={out}",
                                              "decoders=[vanilla]", "progress=false", "plots=false", *extra])


@pytest.fixture
def no_model(monkeypatch):
    import inference.evaluation.eval_run as eval_run

    monkeypatch.setattr(eval_run, "load_for_inference", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(eval_run, "heads_checksum", lambda *a, **k: pytest.fail("read the export"))


@pytest.mark.parametrize("overwrite", ["false", "true"])
def test_a_folder_of_the_users_files_is_refused_and_left_as_it_was(tmp_path, no_model, overwrite):
    from inference.evaluation.eval_run import evaluate

    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.md").write_text("# my notes\n")
    (out / "summary.json").write_text('{"mine": true}\n')
    (out / "run.json").write_text('{"experiment": 7}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(EvalDirError, match=rf"output_dir {out} holds files that are not a medusa-eval run "
                                           r"\(run.json, summary.json, summary.md\).*choose another output_dir"):
        evaluate(eval_config(out, f"overwrite={overwrite}"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_command_refuses_a_users_folder_before_hydra_writes_into_it(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.md").write_text("# my notes\n")
    run = subprocess.run([sys.executable, "-m", "inference.cli.evaluate", f"export_dir={tmp_path / 'export'}",
                          f"output_dir={out}", "decoders=[vanilla]"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert f"medusa-eval: output_dir {out} holds files that are not a medusa-eval run (summary.md)" in run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["summary.md"]  # no .hydra/, no log


def test_the_command_goes_on_in_a_folder_a_run_killed_at_its_start_left(tmp_path):
    # killed before its run.json: only Hydra's log of that run (evaluate.log) and its lock are there
    import subprocess
    import sys

    out = tmp_path / "killed"
    out.mkdir()
    (out / "evaluate.log").write_text("[2026-12-04 22:17:00][inference.evaluation.eval_run][INFO] - loading\n")
    (out / EVAL_LOCK).write_text("{}")
    run = subprocess.run([sys.executable, "-m", "inference.cli.evaluate", f"export_dir={tmp_path / 'export'}",
                          f"output_dir={out}", "decoders=[vanilla]"], capture_output=True, text=True, timeout=120)
    assert "not a medusa-eval run" not in run.stderr  # the folder check passed; the missing export fails next
    assert run.returncode != 0 and "export" in run.stderr
    (out / "notes.txt").write_text("mine")  # anything else is still someone else's
    run = subprocess.run([sys.executable, "-m", "inference.cli.evaluate", f"export_dir={tmp_path / 'export'}",
                          f"output_dir={out}", "decoders=[vanilla]"], capture_output=True, text=True, timeout=120)
    assert f"output_dir {out} holds files that are not a medusa-eval run (notes.txt)" in run.stderr


def test_a_second_run_into_a_folder_is_refused_naming_the_first(tmp_path, no_model):
    from inference.evaluation.eval_run import evaluate

    out = tmp_path / "run"
    holder = start_holder(out, EVAL_LOCK)  # a medusa-eval run writing into the folder
    try:
        with pytest.raises(LockHeldError, match=f"output_dir {out} is in use by another run: pid {holder.pid} on "
                                                f"host {socket.gethostname()}"):
            evaluate(eval_config(out))
        assert sorted(p.name for p in out.iterdir()) == [EVAL_LOCK]
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_our_runs_and_what_hydra_wrote_are_accepted(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "run.json").write_text(json.dumps({"tool": "medusa-eval", "config": {}}))
    (ours / "summary.md").write_text("x")
    check_eval_dir(ours)
    earlier = tmp_path / "earlier"  # a run.json written before the "tool" key was
    earlier.mkdir()
    (earlier / "run.json").write_text(json.dumps({"config": {}, "environment": {}, "decoders": {}}))
    check_eval_dir(earlier)
    fresh = tmp_path / "fresh"
    (fresh / ".hydra").mkdir(parents=True)
    (fresh / "evaluate.log").write_text("")
    (fresh / EVAL_LOCK).write_text("{}")  # left by a killed run
    check_eval_dir(fresh, {".hydra", "evaluate.log"})
    with pytest.raises(EvalDirError, match=r"\(\.hydra, evaluate\.log\)"):
        check_eval_dir(fresh)  # outside Hydra these are someone else's
    check_eval_dir(tmp_path / "new")
    (tmp_path / "file").write_text("")
    with pytest.raises(EvalDirError, match="is a file"):
        check_eval_dir(tmp_path / "file")


def fake_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"tool": "medusa-eval", "overrides": ["decoder.tree.topk=2"]}))
    row = {"tokens_per_second": 2.0, "speedup": 1.5, "mean_accepted_tokens": 1.7, "exact_match_vs_greedy": 1.0,
           "new_tokens": 10}
    (folder / "summary.json").write_text(json.dumps({"decoders": {"vanilla": row, "tree": row}, "prompts": 1}))


def test_a_sweep_writes_its_table_only_into_a_sweep_folder_of_its_own(tmp_path):
    from omegaconf import OmegaConf

    from inference.evaluation.sweep import SweepTableCallback

    def sweep(folder: Path) -> None:
        config = OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}}})
        callback = SweepTableCallback()
        callback.on_multirun_start(config)
        fake_run(folder / "0")  # the job Hydra runs in between
        callback.on_multirun_end(config)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sweep.md").write_text("my table\n")
    (mine / "notes.txt").write_text("mine\n")
    sweep(mine)
    assert (mine / "sweep.md").read_text() == "my table\n" and not (mine / "sweep.jsonl").exists()
    new = tmp_path / "new"
    sweep(new)
    assert "| 0 | tree | 1.50x |" in (new / "sweep.md").read_text()
    fake_run(new / "1")  # a rerun of the sweep into its own folder replaces its table
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(new)}}})
    callback = SweepTableCallback()
    callback.on_multirun_start(config)
    callback.on_multirun_end(config)
    assert len((new / "sweep.jsonl").read_text().splitlines()) == 2
