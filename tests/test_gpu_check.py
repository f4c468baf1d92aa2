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
    (tmp_path / "vllm.json").write_text(json.dumps({"engine": "vllm 0.32.0", "dtype": "bfloat16", "decoders": {
        "vanilla": {**m, "speedup": 1.0}, "medusa": m}}))
    table = _gpu_check().report(tmp_path).splitlines()
    assert len({line.count("|") for line in table}) == 1  # one table: every row has the same columns
    assert table[2] == "| train_1rank | ok | 41 | | | | | logs/train_1rank.log |"
    assert table[3].startswith("| vllm | FAILED (exit 1) | 9 |")
    assert table[4] == "| medusa | measured | 2.0 | 50.0 | 1.50x | 2.00 | 1.00 | medusa-eval, bfloat16 on cuda:0 (H100) |"
    assert [row.split(" | ")[0] for row in table[5:]] == ["| vllm", "| vllm_medusa"]


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
                     ["vllm", "skipped: dry run (vLLM's Medusa speculator needs CUDA)"]]
    summary = json.loads((tmp_path / "out" / "eval" / "summary.json").read_text())
    assert set(summary["decoders"]) == {"vanilla", "medusa", "draft", "lookahead", "hf_assisted", "hf_prompt_lookup"}
    assert "| hf_prompt_lookup | measured |" in run.stdout
