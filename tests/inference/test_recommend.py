"""What to deploy: the fastest candidate overall and per category, its margin and whether it is beyond the noise."""

from __future__ import annotations

import dataclasses

import pytest

from inference.evaluation.recommend import candidates_from_rows, recommend, recommendation_markdown

# seconds per 20-token turn: vanilla 2 s everywhere; prompt lookup 1 s on translation, 2 s on coding; medusa 5/3 s on
# translation, 1 s on coding
SECONDS = {"vanilla": {"translation": 2.0, "coding": 2.0}, "hf_prompt_lookup": {"translation": 1.0, "coding": 2.0},
           "medusa": {"translation": 5 / 3, "coding": 1.0}}


def rows(seconds=SECONDS, prompts=3):
    out = []
    for category in ("translation", "coding"):
        for i in range(prompts):
            for decoder, by_category in seconds.items():
                out.append({"prompt_id": f"{category}-{i}", "turn": 1, "category": category, "decoder": decoder,
                            "new_tokens": 20, "wall_time_s": by_category[category]})
    return out


def test_the_fastest_is_recommended_overall_and_per_category_with_its_margin():
    settings = {"medusa": {"posterior_threshold": 0.09}}
    rec = recommend(candidates_from_rows(rows(), "vanilla", settings, taus={"medusa": 1.8}))
    overall = rec["overall"]
    # medusa: 120 tokens in 8 s against vanilla's 12 s -> 1.5x; prompt lookup 120 in 9 s -> 1.333x
    assert overall["deploy"] == "medusa" and overall["speedup"] == pytest.approx(1.5)
    assert overall["settings"] == {"posterior_threshold": 0.09} and overall["mean_accepted_tokens"] == 1.8
    assert overall["runner_up"] == "hf_prompt_lookup" and overall["runner_up_speedup"] == pytest.approx(4 / 3)
    assert overall["margin"]["estimate"] == pytest.approx(1.125)
    # a resample of mostly translation turns puts prompt lookup ahead: the margin is within the noise
    assert overall["margin"]["low"] < 1.0 and not overall["margin"]["separated"]
    translation, coding = rec["categories"]["translation"], rec["categories"]["coding"]
    assert translation["deploy"] == "hf_prompt_lookup" and translation["speedup"] == pytest.approx(2.0)
    assert translation["margin"]["estimate"] == pytest.approx(2.0 / 1.2) and translation["margin"]["separated"]
    assert coding["deploy"] == "medusa" and coding["margin"]["estimate"] == pytest.approx(2.0)
    text = recommendation_markdown(rec, "cpu, bfloat16")
    assert "deploy **medusa** (posterior_threshold=0.09), 1.50x plain decoding" in text
    assert "within the noise: hf_prompt_lookup serves as well" in text
    assert "| translation | hf_prompt_lookup | 2.00x | medusa | 1.67x [1.67, 1.67] | yes |" in text
    assert text.splitlines()[-1].startswith("| overall | medusa | 1.50x | hf_prompt_lookup | 1.12x [")


def test_plain_decoding_is_a_candidate_and_can_win():
    slow = {"vanilla": {"translation": 2.0, "coding": 2.0}, "medusa": {"translation": 2.5, "coding": 2.2}}
    rec = recommend(candidates_from_rows(rows(slow), "vanilla", {}))
    assert rec["overall"]["deploy"] == "vanilla" and rec["overall"]["speedup"] == pytest.approx(1.0)
    assert rec["overall"]["margin"]["separated"]  # medusa is slower on every turn


def test_candidates_of_several_runs_compare_through_their_own_baselines():
    # run 2's machine was slower for everything: its medusa is 1.6x its own vanilla, run 1's 1.5x
    run1 = [dataclasses.replace(c, label=f"{c.label} (job 0)") for c in candidates_from_rows(rows(), "vanilla", {})]
    slower = {name: {c: 2 * s for c, s in by.items()} for name, by in SECONDS.items()}
    slower["medusa"] = {"translation": 2 * 2.0 / 1.6, "coding": 2 * 2.0 / 1.6}
    run2 = [dataclasses.replace(c, label=f"{c.label} (job 1)")
            for c in candidates_from_rows(rows(slower), "vanilla", {})]
    rec = recommend([c for c in run1 + run2 if c.decoder == "medusa"])
    assert rec["overall"]["deploy"] == "medusa (job 1)" and rec["overall"]["speedup"] == pytest.approx(1.6)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no row of the baseline decoder 'vanilla'.*add vanilla to decoders"):
        candidates_from_rows([r for r in rows() if r["decoder"] != "vanilla"], "vanilla", {})
    with pytest.raises(ValueError, match="no finished rows"):
        recommend([])
    medusa_only = candidates_from_rows(rows()[:3], "vanilla", {})  # one turn of one prompt
    other = candidates_from_rows(rows()[3:6], "vanilla", {})  # another prompt
    with pytest.raises(ValueError, match="no prompt turn was answered by every candidate"):
        recommend([medusa_only[0], other[0]])
