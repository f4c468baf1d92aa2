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
from medusa_train.paths import CONF_DIR
from medusa_train.run_lock import EVAL_LOCK, LockHeldError
from tests.medusa_train.test_tune_lock import start_holder

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
