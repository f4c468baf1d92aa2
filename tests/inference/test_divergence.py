"""Divergences from vanilla's greedy reply: where they start, vanilla's recorded top-2 gaps, the rounding noise of a
dtype, and the near-tie verdict in summary.json."""

from __future__ import annotations

import json

import pytest
import torch

from inference.decoders.base import DecodeConfig
from inference.decoders.vanilla import VanillaDecoder
from inference.evaluation.divergence import explain_divergences, find_divergences, first_divergence, rounding_noise
from inference.evaluation.summary import divergence_lines
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([1], [1, 2]) == 1


def test_vanilla_records_each_tokens_top2_gap_after_the_clock():
    model = make_tiny_model("llama", initializer_range=0.3)
    prompt = [1, 5, 9, 33, 20]
    result = VanillaDecoder(model, record_top2_gaps=True).generate(prompt, DecodeConfig(max_new_tokens=12))
    assert len(result.top2_gaps) == len(result.tokens) == 12
    # the same gaps from one pass over the prompt and the reply (fp32: equal to rounding)
    logits = model(torch.tensor([prompt + result.tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    top = logits.topk(2, dim=-1).values
    assert result.top2_gaps == pytest.approx((top[:, 0] - top[:, 1]).tolist(), abs=1e-4)
    assert VanillaDecoder(model).generate(prompt, DecodeConfig(max_new_tokens=3)).top2_gaps is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_noise_is_measured_at_real_positions(dtype):
    model = make_tiny_model("llama", initializer_range=0.3).to(dtype)
    sequences = [([1, 5, 9, 33, 20] + list(range(40, 60)), 5), ([1, 70] + list(range(10, 30)), 2)]
    noise = rounding_noise(model, sequences, ks=[2, 6], positions=12)
    assert noise["ks"] == [2, 6] and noise["positions"] == 12
    assert 0 <= noise["median_gap_change"] <= noise["p99_gap_change"] <= noise["max_gap_change"]
    if dtype == torch.float32:
        assert noise["max_gap_change"] < 1e-4  # fp32: the 1-token and k-token passes agree to rounding
    with pytest.raises(ValueError, match="ks must be sizes >= 2"):
        rounding_noise(model, sequences, ks=[1])


def _row(decoder, tokens, prompt="p1", gaps=None):
    row = {"prompt_id": prompt, "turn": 1, "decoder": decoder, "tokens": tokens}
    return row if gaps is None else {**row, "top2_gaps": gaps}


def test_divergences_are_near_ties_when_vanillas_gap_is_within_the_noise():
    units = [{"vanilla": _row("vanilla", [5, 6, 7, 8], "p1", [3.0, 0.01, 2.0, 4.0]),
              "medusa": _row("medusa", [5, 9, 7, 8], "p1"), "draft": _row("draft", [5, 6, 7, 8], "p1")},
             {"vanilla": _row("vanilla", [1, 2, 3], "p2", [1.0, 2.0, 5.0]),
              "medusa": _row("medusa", [1, 2, 4], "p2"), "draft": _row("draft", [1, 2, 3], "p2")},
             {"vanilla": _row("vanilla", [1, 2], "p3"), "medusa": _row("medusa", [2, 2], "p3"),
              "draft": _row("draft", [1, 2], "p3")}]
    found = find_divergences(units)
    assert found["medusa"] == [{"prompt_id": "p1", "turn": 1, "position": 1, "vanilla_gap": 0.01},
                               {"prompt_id": "p2", "turn": 1, "position": 2, "vanilla_gap": 5.0},
                               {"prompt_id": "p3", "turn": 1, "position": 0, "vanilla_gap": None}]
    assert found["draft"] == []
    report = explain_divergences(found, {"ks": [2, 6], "positions": 64, "max_gap_change": 0.25}, replies=3)
    assert report["threshold"] == 0.25
    medusa = report["decoders"]["medusa"]
    assert (medusa["diverged"], medusa["near_ties"], medusa["unexplained"]) == (3, 1, 1)
    assert medusa["not_near_ties"] == [found["medusa"][1]]  # gap 5.0 > 0.25: flagged
    assert report["decoders"]["draft"] == {"replies": 3, "diverged": 0, "near_ties": 0, "not_near_ties": [],
                                           "unexplained": 0}
    [line] = divergence_lines(report)
    assert line.startswith("medusa: 3 of 3 replies left vanilla's, 1 at a near-tie (vanilla's top-2 logit gap <= "
                           "0.25") and "NOT near-ties: prompt p2 turn 1 token 2 (gap 5)" in line
    no_noise = explain_divergences(found, None, replies=3)["decoders"]["medusa"]
    assert no_noise["unexplained"] == 3 and no_noise["near_ties"] == 0


def test_a_bf16_eval_explains_every_divergence(tmp_path, monkeypatch):
    from inference.evaluation.eval_run import evaluate
    from tests.inference.test_evaluate import QUESTIONS, TREE, config
    from medusa_train.config.schema import ModelConfig
    from medusa_train.export import save_export
    from medusa_train.loading.export import export_extra_config
    from medusa_train.models.speculative import new_heads_for
    from tests.conftest import make_tiny_tokenizer

    base = make_tiny_model("llama", initializer_range=0.3)
    base.save_pretrained(tmp_path / "base")
    make_tiny_tokenizer().save_pretrained(tmp_path / "base")
    heads = new_heads_for(base, num_heads=2)
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    save_export(heads, tmp_path / "export", str(tmp_path / "base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(tmp_path / "base"))))
    (tmp_path / "export" / "medusa_choices.json").write_text(json.dumps(TREE))
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    summary = evaluate(config(tmp_path / "export", prompts, tmp_path / "run", "dtype=bfloat16", "max_new_tokens=24",
                              "max_turns=1", "noise_positions=16"))
    report = summary["divergences"]
    medusa = report["decoders"]["tree"]
    exact = summary["decoders"]["tree"]["exact_match_vs_greedy"]
    assert medusa["replies"] == 3 and medusa["diverged"] == round(3 * (1 - exact))
    assert medusa["near_ties"] + len(medusa["not_near_ties"]) + medusa["unexplained"] == medusa["diverged"]
    if medusa["diverged"]:  # the noise is measured only when something diverged
        assert report["rounding_noise"]["positions"] == 16 and report["threshold"] is not None
        assert medusa["unexplained"] == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert all(len(r["top2_gaps"]) == r["new_tokens"] for r in rows if r["decoder"] == "vanilla")
    assert all("top2_gaps" not in r for r in rows if r["decoder"] == "tree")

    # A decoder that breaks its reply on purpose at token 3: every reply diverges there, the noise is measured and
    # each divergence is judged against vanilla's gap at token 3.
    from dataclasses import replace

    from inference.decoders.tree import TreeDecoder

    original = TreeDecoder.generate

    def broken(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return replace(result, tokens=result.tokens[:3] + [(result.tokens[3] + 1) % 97] + result.tokens[4:])

    monkeypatch.setattr(TreeDecoder, "generate", broken)
    summary = evaluate(config(tmp_path / "export", prompts, tmp_path / "broken", "dtype=bfloat16",
                              "max_new_tokens=24", "max_turns=1", "noise_positions=16"))
    report = summary["divergences"]
    medusa = report["decoders"]["tree"]
    assert medusa["diverged"] == 3 and medusa["unexplained"] == 0
    assert report["rounding_noise"]["positions"] == 16 and report["rounding_noise"]["ks"] == [2, len(TREE) + 1]
    gaps = {r["prompt_id"]: r["top2_gaps"][3] for r in map(json.loads, (tmp_path / "broken" / "results.jsonl")
                                                           .read_text().splitlines()) if r["decoder"] == "vanilla"}
    flagged = {d["prompt_id"]: d["vanilla_gap"] for d in medusa["not_near_ties"]}
    assert flagged == {p: g for p, g in gaps.items() if g > report["threshold"]}
    assert medusa["near_ties"] == 3 - len(flagged)
    assert "tree: 3 of 3 replies left vanilla's" in (tmp_path / "broken" / "summary.md").read_text()
