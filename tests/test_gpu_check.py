"""launch/gpu_check.sh: its table from the files a check leaves, and (slow) its dry run on the CPU end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_is_one_table_of_steps_and_decoders(tmp_path):
    (tmp_path / "steps.tsv").write_text("train_1rank\tok\t41\tlogs/train_1rank.log\nvllm\tFAILED (exit 1)\t9\tlogs/v\n")
    (tmp_path / "eval").mkdir()
    m = {"tokens_per_second": 50.0, "speedup": 1.5, "mean_accepted_tokens": 2.0, "exact_match_vs_greedy": 1.0,
         "new_tokens": 100, "wall_time_s": 2.0}
    (tmp_path / "eval" / "summary.json").write_text(json.dumps({"dtype": "bfloat16", "device": "cuda:0 (H100)",
                                                                "decoders": {"medusa": m}}))
    v = {"tokens_per_second": 40.0, "speedup": 1.0, "mean_accepted_tokens": 1.0, "exact_match_vs_vllm": 1.0,
         "new_tokens": 100, "wall_time_s": 2.5}  # one engine's entry in serve_vllm.py's summary
    (tmp_path / "vllm.json").write_text(json.dumps({"engine": "vllm 0.32.0", "dtype": "bfloat16", "batches": {
        "1": {"vllm": v, "vllm_medusa": {**v, "speedup": 0.75, "exact_match_vs_vllm": 0.5}}}}))
    table = _gpu_check().report(tmp_path).splitlines()
    assert len({line.count("|") for line in table}) == 1  # one table: every row has the same columns
    assert table[2] == "| train_1rank | ok | 41 | | | | | logs/train_1rank.log |"
    assert table[3].startswith("| vllm | FAILED (exit 1) | 9 |")
    assert table[4] == "| medusa | measured | 2.0 | 50.0 | 1.50x | 2.00 | 1.00 | medusa-eval, bfloat16 on cuda:0 (H100) |"
    assert [row.split(" | ")[0] for row in table[5:]] == ["| vllm", "| vllm_medusa"]
    assert table[6] == "| vllm_medusa | measured | 2.5 | 40.0 | 0.75x | 1.00 | 0.50 | vllm 0.32.0, bfloat16, batch 1 |"


def test_the_report_labels_the_eagle3_rows_and_every_vllm_batch(tmp_path):
    """The EAGLE-3 drafter's eval and vLLM summaries (eval_eagle3/, vllm_eagle3.json) get rows of their own, after
    the Medusa heads' (eval/), one per serve_vllm.py batch size."""
    m = {"tokens_per_second": 30.0, "speedup": 1.2, "mean_accepted_tokens": 1.8, "exact_match_vs_greedy": 1.0,
         "new_tokens": 64, "wall_time_s": 1.0}
    v = {"tokens_per_second": 20.0, "speedup": 1.1, "mean_accepted_tokens": 1.4, "exact_match_vs_vllm": 1.0,
         "new_tokens": 64, "wall_time_s": 3.2}
    for folder, decoders in (("eval", {"vanilla": m, "medusa": m}), ("eval_eagle3", {"medusa": {**m, "speedup": 1.4}})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "summary.json").write_text(json.dumps({"dtype": "float32", "device": "cpu",
                                                                    "decoders": decoders}))
    (tmp_path / "vllm_eagle3.json").write_text(json.dumps({"engine": "vllm 0.32.0", "dtype": "bfloat16", "batches": {
        "1": {"vllm": v, "vllm_eagle3": v}, "8": {"vllm": {**v, "tokens_per_second": 90.0}, "vllm_eagle3": v}}}))
    table = _gpu_check().report(tmp_path).splitlines()
    assert [row.split(" | ")[0] for row in table[2:]] == ["| vanilla", "| medusa", "| medusa [eagle3]", "| vllm [eagle3]",
                                                          "| vllm_eagle3 [eagle3]", "| vllm [eagle3]",
                                                          "| vllm_eagle3 [eagle3]"]
    assert table[4] == "| medusa [eagle3] | measured | 1.0 | 30.0 | 1.40x | 1.80 | 1.00 | medusa-eval, float32 on cpu |"
    assert table[7] == "| vllm [eagle3] | measured | 3.2 | 90.0 | 1.10x | 1.40 | 1.00 | vllm 0.32.0, bfloat16, batch 8 |"


def test_without_a_gpu_the_check_asks_for_the_dry_run(tmp_path):
    if subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0:
        pytest.skip("this machine has a GPU")
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), "--skip-install"], capture_output=True,
                         text=True, env={**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out")})
    assert run.returncode == 2 and "run launch/gpu_check.sh --dry-run" in run.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.slow
def test_the_dry_run_trains_tunes_and_evaluates_at_toy_size(tmp_path):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), "MEDUSA_VENV": str(Path(sys.executable).parents[1])}
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), "--dry-run", "--skip-install"],
                         capture_output=True, text=True, env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = [line.split("\t")[:2] for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()]
    assert steps == [["install", "skipped: --skip-install"], ["torch", "ok"], ["install_vllm", "skipped: dry run"],
                     ["train_1rank", "ok"], ["train_2ranks", "ok"], ["tune_tree", "ok"], ["eval", "ok"],
                     ["vllm", "skipped: dry run (vLLM's Medusa speculator needs CUDA)"],
                     ["train_eagle3_1rank", "ok"], ["export_eagle3", "ok"], ["train_eagle3_2ranks", "ok"],
                     ["tune_tree_eagle3", "ok"], ["eval_eagle3", "ok"], ["vllm_eagle3", "skipped: dry run"]]
    summary = json.loads((tmp_path / "out" / "eval" / "summary.json").read_text())
    assert set(summary["decoders"]) == {"vanilla", "medusa", "composite", "draft", "lookahead", "hf_assisted",
                                        "hf_prompt_lookup"}
    assert "| hf_prompt_lookup | measured |" in run.stdout
    eagle3 = tmp_path / "out" / "eagle3" / "export"
    assert json.loads((eagle3 / "speculators" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert (eagle3 / "dynamic_tree.json").is_file()  # the tuner chose the EAGLE-2 tree our decoder then ran
    summary = json.loads((tmp_path / "out" / "eval_eagle3" / "summary.json").read_text())
    assert set(summary["decoders"]) == {"vanilla", "medusa"}
    assert "| medusa [eagle3] | measured |" in run.stdout
