"""Spec-Bench as a built-in prompt set, its per-category selection, the leaderboard layout of summary.md, and the
bad input around them."""

from __future__ import annotations

import hashlib

import pytest
from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas
from inference.evaluation.eval_config import EvaluateConfig
from inference.evaluation.eval_run import load_eval_prompts
from inference.evaluation.summary import leaderboard_markdown
from medusa_train.config.schema import as_dataclass
from inference.conf import CONF_DIR
from medusa_train.chat.prompts import SPEC_BENCH_FILE

register_schemas()

CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "translation",
              "summarization", "qa", "math_reasoning", "rag"]


def eval_config(tmp_path, *extra: str) -> EvaluateConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"export_dir={tmp_path}", f"output_dir={tmp_path / 'out'}",
                                             "prompts=spec_bench", *extra])
    return as_dataclass(EvaluateConfig, cfg)


def test_the_shipped_file_is_spec_benchs_480_questions():
    # the sha256 its README records (hemingkx/Spec-Bench at fd2c1cd, data/spec_bench/question.jsonl)
    assert hashlib.sha256(SPEC_BENCH_FILE.read_bytes()).hexdigest() == \
        "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
    assert (SPEC_BENCH_FILE.parent / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_per_category_spans_the_13_categories_in_order(tmp_path):
    prompts = load_eval_prompts(eval_config(tmp_path, "per_category=2"))
    assert [p.category for p in prompts] == [c for c in CATEGORIES for _ in range(2)]
    assert [p.id for p in prompts[:2]] == ["81", "82"] and [p.id for p in prompts[16:18]] == ["161", "162"]
    assert len(load_eval_prompts(eval_config(tmp_path))) == 480


def test_categories_keeps_only_those_asked_for(tmp_path):
    prompts = load_eval_prompts(eval_config(tmp_path, "categories=[rag,translation]", "per_category=3"))
    assert [p.category for p in prompts] == ["translation"] * 3 + ["rag"] * 3  # in the file's order


def test_empty_selections_are_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match=r"categories=\[\] names no category"):
        eval_config(tmp_path, "categories=[]")
    with pytest.raises(ValueError, match="categories: ShareGPT prompts form one category"):
        eval_config(tmp_path, "categories=[rag]", "prompts=sharegpt")
    with pytest.raises(ValueError, match=r"no prompt selected from prompts=spec_bench: prompt_offset=100000 skips "
                                         r"past its 480 prompts"):
        load_eval_prompts(eval_config(tmp_path, "prompt_offset=100000"))


def test_bad_selections_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"per_category must be >= 1 or null, got 0"):
        eval_config(tmp_path, "per_category=0")
    with pytest.raises(ValueError, match=r"categories: \['poetry'\] not in prompts=spec_bench; its categories are "
                                         r"writing, roleplay, .*, rag$"):
        load_eval_prompts(eval_config(tmp_path, "categories=[poetry,rag]"))


def test_a_sweep_folder_without_a_finished_run_is_named(tmp_path, capsys):
    from inference.evaluation.sweep import main

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "results.jsonl").write_text("")  # started, not finished: no summary.json
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path)])
    assert exit_.value.code == 2
    assert (f"{tmp_path} holds no finished run (summary.json in it or in its numbered subfolders)" in
            capsys.readouterr().err.replace("\n", " "))


def test_the_sweep_table_is_not_written_over_a_users_files(tmp_path, capsys):
    from inference.evaluation.sweep import main
    from tests.inference.test_eval_folder_safety import fake_run

    fake_run(tmp_path / "sweep" / "0")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sweep.md").write_text("my table\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "sweep"), "--out", str(mine)])
    assert "holds files that are not a medusa-eval sweep (sweep.md)" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["sweep.md"] and (mine / "sweep.md").read_text() == "my table\n"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "sweep"), "--out", str(tmp_path / "afile")])
    assert "is a file" in capsys.readouterr().err


def test_the_leaderboard_has_a_row_per_decoder_and_the_overall_speedup_last():
    def metrics(speedup, tau=1.0, low=None, high=None):
        interval = None if low is None else {"low": low, "high": high}
        return {"speedup": speedup, "mean_accepted_tokens": tau, "speedup_interval": interval}

    table = {"overall": {"vanilla": metrics(1.0, 1.0, 1.0, 1.0), "medusa": metrics(1.2, 1.5, 1.1, 1.3)},
             "coding": {"vanilla": metrics(1.0), "medusa": metrics(1.4)},
             "translation": {"vanilla": metrics(1.0), "medusa": metrics(0.9)}}
    assert leaderboard_markdown(table).splitlines() == [
        "| decoder | coding | translation | τ | overall |",
        "| --- | ---: | ---: | ---: | ---: |",
        "| vanilla | 1.00x | 1.00x | 1.00 | 1.00x [1.00, 1.00] |",
        "| medusa | 1.40x | 0.90x | 1.50 | 1.20x [1.10, 1.30] |"]
