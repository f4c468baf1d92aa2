"""medusa-tune-tree chooses the composite tree's budget split (heads' nodes, lookup length, lookup matches) by
decoding, writes ``composite_tree.json``, checks it when read; medusa-eval's ``composite`` decoder decodes with it
(exactly greedy in fp32), an explicit setting wins, and bad settings are refused before the accuracy pass."""

from __future__ import annotations

import json

import pytest

from inference.decoders import DecodeConfig
from inference.registry import BuildContext, build_decoder, decoder_settings
from medusa_train.export.tree_files import read_tree_files
from medusa_train.loading.runtime import load_for_inference
from medusa_train.tree.composite import CompositeTree
from tests.inference.test_decoders import PROMPTS, greedy
from tests.inference.test_tune_tree_dynamic import _tune, exports  # noqa: F401 (a fixture)


def test_the_shortlist_changes_one_factor_at_a_time_and_fits_max_nodes():
    from inference.tuning.composite import composite_shortlist

    reference, splits = composite_shortlist(11, None, [4, 10, 16], [1, 2], max_nodes=31)
    assert reference == (11, 10, 1)
    assert splits == [(11, 10, 1), (5, 10, 1), (11, 4, 1), (11, 16, 1), (11, 10, 2)]  # (22, 10, 1): 32 > 31 left out
    # a small budget cuts the reference's lookup and heads to fit
    assert composite_shortlist(5, [2], [3], [1], max_nodes=7)[0] == (1, 6, 1)
    with pytest.raises(ValueError, match="composite_lengths is empty"):
        composite_shortlist(5, None, [], [1], max_nodes=31)
    with pytest.raises(ValueError, match=r"max_nodes=1 leaves no room for a composite tree .* composite=false"):
        composite_shortlist(5, None, [4], [1], max_nodes=1)


def test_tune_tree_chooses_the_split_by_decoding_and_the_composite_decoder_uses_it(exports, capsys):
    from inference.tuning.composite import composite_shortlist, sum_nodes
    from inference.tuning.search import greedy_tree
    from inference.tuning.timed import choose

    _, medusa, prompts = exports
    result = _tune(medusa, prompts, "max_nodes=12", "composite_lengths=[2,4]", "composite_matches=[1,2]")
    written = json.loads((medusa / "composite_tree.json").read_text())
    assert written == json.loads(json.dumps(result["composite_tree"]))
    assert read_tree_files(medusa, num_heads=3, head_vocab=97)["composite_tree"] == written  # passes its own check
    chosen = written["chosen"]
    reference, splits = composite_shortlist(len(result["medusa_choices"]), None, [2, 4], [1, 2], 12)
    timed = {(row["heads_nodes"], row["lookup_length"], row["lookup_matches"]): row for row in chosen["timed"]}
    assert list(timed) == splits and chosen["timed_prompts"] == 3 and chosen["timed_new_tokens"] == 10
    kept, margin = choose(timed, reference)  # the recorded table decides, by the static tree's rule
    assert (written["heads_nodes"], written["lookup_length"], written["lookup_matches"]) == kept
    assert chosen["margin"] == margin and written["nodes"] == sum_nodes(kept)
    head_accuracy = json.loads((medusa / "head_accuracy.json").read_text())
    assert written["medusa_choices"] == greedy_tree(head_accuracy["acc"], written["nodes"])  # the whole budget
    for row in timed.values():  # no EOS: 3 prompts x 9 tokens after the prefill's
        assert row["tokens"] == 3 * 9 and row["mean_accepted_tokens"] >= 1.0
    out = capsys.readouterr().out
    assert "with each shortlisted composite tree:" in out and "heads  lookup  matches  nodes  tokens/s" in out
    assert (f"kept the composite tree of {written['heads_nodes']} heads' nodes + {written['lookup_matches']} x "
            f"{written['lookup_length']} lookup tokens ({written['nodes']} nodes)") in out

    model, tokenizer, _, _ = load_for_inference(str(medusa), dtype="float32")
    ctx = BuildContext(model=model, tokenizer=tokenizer, export_dir=str(medusa), dtype="float32")
    built = build_decoder("composite", decoder_settings("composite", {"acceptance": "greedy"}), ctx)
    split = CompositeTree(written["nodes"], written["lookup_length"], written["lookup_matches"])
    assert built.decoder.composite == split and built.decoder.name == "composite"
    assert built.info["tree_source"] == built.info["composite_source"] == "export composite_tree.json"
    for prompt in PROMPTS:  # fp32 greedy: plain greedy decoding's tokens
        assert built.decoder.generate(prompt, DecodeConfig(max_new_tokens=24)).tokens == greedy(model.base, prompt, 24)
    # a setting wins over the file, field by field
    mine = build_decoder("composite", decoder_settings("composite", {"lookup_length": 1}), ctx)
    assert mine.decoder.composite.lookup_length == 1 and mine.decoder.composite.nodes == written["nodes"]
    assert mine.info["composite_source"] == "export composite_tree.json+settings"  # in the fields' order


def test_without_the_file_the_split_defaults_to_the_heads_tree_and_transformers_lookup(exports):
    _, medusa, _ = exports
    model, tokenizer, _, _ = load_for_inference(str(medusa), dtype="float32")
    ctx = BuildContext(model=model, tokenizer=tokenizer, export_dir=str(medusa), dtype="float32")
    built = build_decoder("composite", decoder_settings("composite", {"medusa_choices": [[0], [0, 0], [1]]}), ctx)
    assert built.decoder.composite == CompositeTree(nodes=3 + 10, lookup_length=10, lookup_matches=1)
    assert built.info["composite_source"] == "default"
    assert built.info["tree_source"] == "decoder.composite.medusa_choices"
    with pytest.raises(ValueError, match=r"decoder\.composite\.nodes=5 is smaller than the lookup drafts' 10"):
        build_decoder("composite", decoder_settings("composite", {"nodes": 5, "lookup_length": 10}), ctx)


def test_composite_false_writes_no_file(exports):
    _, medusa, prompts = exports
    result = _tune(medusa, prompts, "composite=false", "timed_prompts=1")
    assert result["composite_tree"] is None and not (medusa / "composite_tree.json").exists()


@pytest.mark.parametrize("fields,message", [
    ({"nodes": 3}, r"composite\.nodes=3 is smaller than the lookup drafts' 4 tokens"),
    ({"lookup_length": 0}, r"composite\.lookup_length must be a positive int, got 0"),
    ({"medusa_choices": [[0, 0]]}, r"medusa_choices\[0\] = \[0, 0\]: its prefix \[0\] is missing"),
    ({"tokens_per_s": -1.0}, r"tokens_per_s = -1\.0 must be a finite number > 0 or null"),
])
def test_a_bad_composite_tree_json_is_refused_naming_the_file_and_field(exports, fields, message):
    _, medusa, _ = exports
    record = {"nodes": 8, "lookup_length": 4, "lookup_matches": 1, "max_matching_ngram_size": 2, "heads_nodes": 4,
              "medusa_choices": [[0], [1], [0, 0]], "tokens_per_s": 10.0, "mean_accepted_tokens": 1.5,
              "chosen": {"by": "timed"}, **fields}
    (medusa / "composite_tree.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=rf"{medusa}/composite_tree\.json: {message}"):
        read_tree_files(medusa)


def test_composite_settings_are_refused_by_name_before_the_accuracy_pass(exports, monkeypatch):
    _, medusa, prompts = exports

    def no_measuring(*args, **kwargs):
        raise AssertionError("head accuracy measured before the composite settings were checked")

    monkeypatch.setattr("inference.tuning.tune.measure_head_accuracy", no_measuring)
    with pytest.raises(ValueError, match=r"composite_lengths\[0\] must be >= 1 .* got 0"):
        _tune(medusa, prompts, "composite_lengths=[0]")
    with pytest.raises(ValueError, match="composite_matches is empty"):
        _tune(medusa, prompts, "composite_matches=[]")
