"""medusa-eval's ``composite`` decoder given bad or unusual settings and a hand-edited ``composite_tree.json``: a
malformed tree is refused naming its path (no traceback), a file deeper than the heads names the file, and a node
budget valid with the export's tuned lookup is not refused on the default lookup's account."""

from __future__ import annotations

import json

import pytest

from inference.registry import BuildContext, build_decoder, decoder_settings
from medusa_train.loading.runtime import load_for_inference
from medusa_train.tree.composite import CompositeTree
from tests.inference.test_tune_tree_dynamic import exports  # noqa: F401 (a fixture)

RECORD = {"nodes": 8, "lookup_length": 3, "lookup_matches": 1, "max_matching_ngram_size": 2, "heads_nodes": 5,
          "medusa_choices": [[0], [1], [0, 0]], "tokens_per_s": 10.0, "mean_accepted_tokens": 1.5,
          "chosen": {"by": "timed"}}


def _context(export) -> BuildContext:
    model, tokenizer, _, _ = load_for_inference(str(export), dtype="float32")
    return BuildContext(model=model, tokenizer=tokenizer, export_dir=str(export), dtype="float32")


def test_malformed_settings_trees_are_refused_naming_the_path(exports):
    ctx = _context(exports[1])
    for choices, message in (([[0], []], r"medusa_choices\[1\] = \[\]: a path must not be empty"),
                             ([], r"medusa_choices is empty"),
                             ([[0], 5], r"medusa_choices\[1\] = 5: a path must be a list of ranks"),
                             ([["a"]], r"medusa_choices\[0\] = \['a'\]: ranks must be ints")):
        with pytest.raises(ValueError, match=message):
            build_decoder("composite", decoder_settings("composite", {"medusa_choices": choices}), ctx)


def test_a_composite_tree_json_deeper_than_the_heads_is_refused_naming_the_file(exports):
    medusa = exports[1]
    ctx = _context(medusa)  # the file is written after the model loaded (load_for_inference checks it too)
    (medusa / "composite_tree.json").write_text(json.dumps(
        {**RECORD, "medusa_choices": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    with pytest.raises(ValueError, match=rf"{medusa}/composite_tree\.json: medusa_choices\[3\] = \[0, 0, 0, 0\]: "
                                         r"depth 4 exceeds num_heads=3"):
        build_decoder("composite", decoder_settings("composite", {}), ctx)


def test_a_node_budget_that_fits_the_exports_lookup_is_not_refused(exports):
    medusa = exports[1]
    ctx = _context(medusa)
    # without a tuned file the default 10-token lookup applies: refused by name when the decoder is built
    with pytest.raises(ValueError, match=r"decoder\.composite\.nodes=5 is smaller than the lookup drafts' 10 tokens"):
        build_decoder("composite", decoder_settings("composite", {"nodes": 5, "medusa_choices": [[0]]}), ctx)
    (medusa / "composite_tree.json").write_text(json.dumps(RECORD))
    built = build_decoder("composite", decoder_settings("composite", {"nodes": 5}), ctx)
    assert built.decoder.composite == CompositeTree(nodes=5, lookup_length=3, lookup_matches=1)
    assert built.info["composite_source"] == "settings+export composite_tree.json"
    # set lookup fields are still checked before any model loads
    with pytest.raises(ValueError, match=r"decoder\.composite\.nodes=5 is smaller than the lookup drafts' 6 tokens"):
        decoder_settings("composite", {"nodes": 5, "lookup_length": 3, "lookup_matches": 2})
