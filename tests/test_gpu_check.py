"""launch/gpu_check.sh and launch/gpu_wheels.sh: the check's table from the files it leaves, its refusal without a GPU,
the wheels' list, and (slow) its dry run on the CPU end to end, so the script cannot rot between sessions lent a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


def test_the_report_has_the_steps_then_exactness_speed_and_memory(tmp_path):
    (tmp_path / "steps.tsv").write_text("train_medusa1\tok\t41\tlogs/train_medusa1.log\n"
                                        "train_2groups_nccl\trefused (exit 1), gloo used\t9\tlogs/n.log\n")
    (tmp_path / "exact.json").write_text(json.dumps({"rows": [
        {"drafter": "medusa", "dtype": "bfloat16", "device": "cuda", "identical_replies": 2 / 3,
         "mean_accepted_tokens": 1.25}]}))
    (tmp_path / "speed.json").write_text(json.dumps({
        "params": 8.03e9, "layers": 32, "dtype": "bfloat16", "device": "cuda", "prompts": 4, "new_tokens": 64,
        "decoders": {"vanilla": {"tokens_per_second": 40.0, "seconds_per_prompt_median": 1.6},
                     "medusa": {"tokens_per_second": 30.0, "seconds_per_prompt_median": 2.1,
                                "mean_accepted_tokens": 1.05, "speedup": 0.75}}}))
    (tmp_path / "memory.json").write_text(json.dumps({"device": "cuda", "rows": [
        {"stage": "medusa-1 run", "planned_gib": 2.0, "measured_gib": 1.5, "ratio": 0.75}]}))
    table = _gpu_check().report(tmp_path).splitlines()
    assert table[2] == "| train_medusa1 | ok | 41 | logs/train_medusa1.log |"
    assert table[3] == "| train_2groups_nccl | refused (exit 1), gloo used | 9 | logs/n.log |"
    assert "| medusa | bfloat16 | cuda | 0.67 | 1.25 |" in table
    assert table[table.index("| vanilla | 40.0 | 1.600 | n/a | n/a |") + 1] == "| medusa | 30.0 | 2.100 | 1.05 | 0.75 |"
    assert "| medusa-1 run | 2.000 | 1.500 | 0.75 |" in table
    assert any(line.startswith("| speed: 8.03B params (32 layers), bfloat16 on cuda") for line in table)


def test_without_a_gpu_the_check_asks_for_the_dry_run(tmp_path):
    if subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0:
        pytest.skip("this machine has a GPU")
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh")], capture_output=True, text=True,
                         env={**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out")})
    assert run.returncode == 2 and "run launch/gpu_check.sh --dry-run" in run.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_wheels_cover_what_the_image_lacks_and_meet_the_projects_requirements():
    """launch/gpu_wheels.sh pins one version of each package the check imports that the GPU image lacks, each within
    the range pyproject.toml asks for (the versions of a fresh install can move on; these must not fall outside)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from packaging.requirements import Requirement

    script = (ROOT / "launch" / "gpu_wheels.sh").read_text()
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^ ]*) ', script))
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "deepspeed"} <= set(pinned)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["deepspeed"]]
    for requirement in wanted:
        if requirement.name in pinned:
            assert requirement.specifier.contains(pinned[requirement.name]), (requirement, pinned[requirement.name])
    assert {r.name for r in wanted} >= {"hydra-core", "omegaconf", "datasets", "deepspeed"}


@pytest.mark.slow
def test_the_dry_run_trains_checks_exactness_memory_and_speed(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_OUT": str(out), "GPU_CHECK_PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = [line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()]
    assert [name for name, _ in steps] == ["wheels", "env", "inputs", "train_medusa1", "train_eagle3",
                                           "train_2groups_gloo", "exact", "memory", "speed"]
    assert all(status == "ok" for name, status in steps if name != "wheels")
    exact = json.loads((out / "exact.json").read_text())["rows"]
    assert {r["drafter"] for r in exact} == {"medusa", "hydra", "eagle3"}
    assert all(r["identical_replies"] == 1.0 for r in exact)  # fp32: token for token
    memory = json.loads((out / "memory.json").read_text())["rows"][0]
    assert memory["planned_gib"] > 0 and memory["measured_gib"] is None  # nothing to measure on a CPU
    speed = json.loads((out / "speed.json").read_text())["decoders"]
    assert speed["vanilla"]["tokens_per_second"] > 0 and speed["medusa"]["mean_accepted_tokens"] >= 1.0
    assert (out / "groups_gloo" / "export").is_dir()  # the two torchrun groups trained and exported
