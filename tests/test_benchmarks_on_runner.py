"""The benchmark scripts on medusa-eval's runner. medusa_speed.py: HF generate and each tree of a tiny export
interleaved, every tree greedy-exact in fp32, a rerun resumed (nothing measured twice), a folder of other settings
refused. medusa2_vs_medusa1.py: two exports' trees interleaved, the fine-tuned base's drift measured."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from tests.conftest import make_tiny_model, make_tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def speed():
    threads = torch.get_num_threads()
    yield script("medusa_speed")
    torch.set_num_threads(threads)


def make_export(root: Path, name: str, drift: float = 0.0) -> Path:
    """A tiny Llama (its base in ``root/name-base``, each weight moved by ``drift`` times Gaussian noise: a fine-tuned
    base) with 2 Medusa heads whose residual blocks are random (so drafts are sometimes rejected and exactness is
    tested), a tuned tree and an accuracy table."""
    base = make_tiny_model("llama")
    with torch.no_grad():
        noise = torch.Generator().manual_seed(1)
        for weight in base.parameters():
            weight.add_(drift * torch.randn(weight.shape, generator=noise))
    base.save_pretrained(root / f"{name}-base")
    make_tiny_tokenizer().save_pretrained(root / f"{name}-base")
    heads = new_heads_for(base, num_heads=2)
    with torch.no_grad():
        heads.block_weight.copy_(torch.randn(heads.block_weight.shape, generator=torch.Generator().manual_seed(0)))
    export = root / name
    save_export(heads, export, str(root / f"{name}-base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(root / f"{name}-base"))))
    (export / "medusa_choices.json").write_text(json.dumps([[0], [0, 0], [1]]))
    (export / "head_accuracy.json").write_text(json.dumps({"acc": [[0.5, 0.2], [0.3, 0.1]], "topk": 2}))
    return export


@pytest.fixture()
def export(tmp_path) -> Path:
    return make_export(tmp_path, "export")


def run(speed, monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["medusa_speed.py", *args])
    speed.main()


def test_trees_beside_hf_generate_exact_and_resumed(speed, export, tmp_path, monkeypatch, capsys):
    out = tmp_path / "speed"
    args = ["--export", str(export), "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "8", "--topk", "2",
            "--threads", "1", "--output-dir", str(out)]
    run(speed, monkeypatch, *args)
    summary = json.loads((out / "medusa_speed.json").read_text())
    decoders = summary["decoders"]
    assert list(decoders) == ["hf_generate", "tree[tuned]", "tree[mc_sim_7b_63]", "tree[chain]"]
    assert summary["prompts"] == 2
    for name, m in decoders.items():
        assert m["exact_match_vs_greedy"] == 1.0, name  # greedy verification is lossless in fp32
        assert m["baseline"] == "hf_generate"
        assert m["new_tokens"] > 0
    assert decoders["tree[tuned]"]["nodes"] == 4 and decoders["tree[chain]"]["nodes"] == 3
    assert decoders["hf_generate"]["mean_accepted_tokens"] == 1.0
    assert summary["predicted_tau_tuned"]["formula"] == pytest.approx(1 + 0.5 + 0.5 * 0.3 + 0.2)  # root, [0], [0,0], [1]
    rows = (out / "results.jsonl").read_text().splitlines()
    assert len(rows) == 2 * 4

    run(speed, monkeypatch, *args)  # the same command again: every row resumed, none measured twice
    assert (out / "results.jsonl").read_text().splitlines() == rows

    with pytest.raises(ValueError, match="max_new_tokens: 8 there, 9 now"):
        run(speed, monkeypatch, *args[:7], "9", *args[8:])
    assert (out / "results.jsonl").read_text().splitlines() == rows


def test_medusa2_against_medusa1_on_the_runner(export, tmp_path, monkeypatch):
    other = make_export(tmp_path, "medusa2", drift=0.002)  # the fine-tuned base: drifted a little
    out = tmp_path / "m2"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(sys, "argv", ["medusa2_vs_medusa1.py", "--medusa1", str(export), "--medusa2", str(other),
                                          "--prompts", "3", "--offset", "0", "--max-new-tokens", "8", "--topk", "2",
                                          "--ppl-conversations", "2", "--output-dir", str(out)])
        script("medusa2_vs_medusa1").main()
    finally:
        torch.set_num_threads(threads)
    report = json.loads((out / "medusa2_vs_medusa1.json").read_text())
    assert list(report["mean_accepted_tokens"]) == ["medusa1[own tree]", "medusa1[mc_sim_7b_63]",
                                                    "medusa2[own tree]", "medusa2[mc_sim_7b_63]"]
    assert all(tau >= 1.0 for tau in report["mean_accepted_tokens"].values())
    # Medusa-1's two trees decode the original model greedily, losslessly; the other base says something else
    assert report["replies_unchanged"]["medusa1[mc_sim_7b_63]"] == 1.0
    assert report["replies_unchanged"]["medusa2[own tree]"] == report["replies_unchanged"]["medusa2[mc_sim_7b_63]"]
    assert 0 < report["agreement_positions"] <= 3 * 8 and 0.5 < report["greedy_agreement"] <= 1.0
    assert set(report["perplexity"]) == {"medusa1", "medusa2"} and 0 < abs(report["perplexity_change"]) < 0.2
    assert len((out / "results.jsonl").read_text().splitlines()) == report["prompts"] * 4
