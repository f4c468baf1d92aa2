"""medusa-tune-tree for drafters that grow an EAGLE-2 dynamic tree (EAGLE-3): the shape (depth, topk, total) is
chosen by decoding a shortlist on the tuning prompts, written to ``dynamic_tree.json``, checked when read, and the
decoder's default for such drafters (an explicit setting wins); Medusa exports get none."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from inference.cli.tune_tree import register_schemas
from inference.decoders import DecodeConfig, TreeDecoder
from inference.registry import BuildContext, build_decoder, decoder_settings
from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.export.tree_files import read_tree_files
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from medusa_train.tree.dynamic import DynamicTree
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.inference.test_decoders import PROMPTS, greedy

register_schemas()  # what conf/tune_tree.yaml composes from

# 3 prompts; latency sizes 1, 4, 8 with max_nodes 7: totals 3 and 7
COMMON = ["prompts.source=jsonl", "max_new_tokens=12", "topk=4", "latency_sizes=[1,4,8]", "context_length=16",
          "repeats=1", "max_nodes=7", "timed_new_tokens=10", "dtype=float32"]
SHAPE = {"depth": 3, "topk": 4, "total": 7}


def _export(tmp_path, name: str, head_type: str, **options):
    base = make_tiny_model("llama")
    if not (tmp_path / "base").exists():
        base.save_pretrained(tmp_path / "base")
        make_tiny_tokenizer().save_pretrained(tmp_path / "base")
    heads = new_heads_for(base, 3, head_type=head_type, **options)
    save_export(heads, tmp_path / name, str(tmp_path / "base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(tmp_path / "base"))))
    return tmp_path / name


@pytest.fixture
def exports(tmp_path):
    """A random EAGLE-3 drafter's export (the taps 0, 1, 2 of a two-layer target), a Medusa export of the same base,
    and three prompts."""
    eagle3 = _export(tmp_path, "eagle3", "eagle3", feature_layers=(0, 1, 2))
    medusa = _export(tmp_path, "medusa", "medusa")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                 for i, t in enumerate(["hello there", "tell me a story", "abc"])) + "\n")
    return eagle3, medusa, prompts


def _tune(export, prompts, *overrides):
    from inference.cli.tune_tree import run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return run(compose("tune_tree", overrides=[f"export_dir={export}", f"prompts.path={prompts}", *COMMON,
                                                   *overrides]))


def _write_shape(export, **fields):
    record = {**SHAPE, "tokens_per_s": 10.0, "mean_accepted_tokens": 1.5, "chosen": {"by": "timed"}, **fields}
    (export / "dynamic_tree.json").write_text(json.dumps(record))


def test_the_shortlist_is_the_grids_middle_and_one_setting_changed_at_a_time():
    from inference.tuning.dynamic import dynamic_shortlist

    reference, shapes = dynamic_shortlist([3, 4, 5, 6], [4, 8], [1, 3, 7, 15, 23, 31, 47, 63])
    assert reference == DynamicTree(4, 8, 15) and shapes[0] == reference
    assert shapes[1:] == [DynamicTree(3, 8, 15), DynamicTree(5, 8, 15), DynamicTree(6, 8, 15),
                          DynamicTree(4, 4, 15),
                          DynamicTree(1, 8, 1), DynamicTree(3, 8, 3),  # a total below the depth: depth = total
                          DynamicTree(4, 8, 7), DynamicTree(4, 8, 23), DynamicTree(4, 8, 31), DynamicTree(4, 8, 47),
                          DynamicTree(4, 8, 63)]
    # a total the middle cannot draft is left out (depth 2, topk 2: 2 + 4 = 6 nodes at most)
    assert dynamic_shortlist([2], [2], [3, 7]) == (DynamicTree(2, 2, 3), [DynamicTree(2, 2, 3)])
    with pytest.raises(ValueError, match=r"no total in \[7\] fits a dynamic tree of depth 2 and topk 2"):
        dynamic_shortlist([2], [2], [7])
    with pytest.raises(ValueError, match="dynamic_depths is empty"):
        dynamic_shortlist([], [2], [7])


def test_tune_tree_chooses_the_dynamic_tree_by_decoding_and_writes_it(exports, capsys):
    from inference.tuning.dynamic import dynamic_shortlist, timed_table
    from inference.tuning.timed import choose, fastest

    eagle3, _, prompts = exports
    result = _tune(eagle3, prompts, "dynamic_depths=[2,3]", "dynamic_topks=[2,4]")
    written = json.loads((eagle3 / "dynamic_tree.json").read_text())
    assert written == json.loads(json.dumps(result["dynamic_tree"]))
    assert read_tree_files(eagle3, head_vocab=97)["dynamic_tree"] == written  # it passes its own check
    chosen = written["chosen"]
    # the grid: depths {2, 3}, topks {2, 4}, totals {3, 7} (latency sizes 4 and 8 less the root)
    reference, shapes = dynamic_shortlist([2, 3], [2, 4], [3, 7])
    assert reference == DynamicTree(2, 4, 3) and chosen["reference"] == reference.as_dict()
    timed = timed_table(chosen)
    assert list(timed) == shapes == [DynamicTree(2, 4, 3), DynamicTree(3, 4, 3), DynamicTree(2, 2, 3),
                                     DynamicTree(2, 4, 7)]
    assert chosen["by"] == "timed" and chosen["timed_prompts"] == 3 and chosen["timed_new_tokens"] == 10
    kept, margin = choose(timed, reference)  # the recorded table decides, by the static tree's rule
    assert DynamicTree(written["depth"], written["topk"], written["total"]) == kept and chosen["margin"] == margin
    assert kept in (reference, fastest(timed))
    assert written["tokens_per_s"] == timed[kept]["tokens_per_s"]
    assert written["mean_accepted_tokens"] == timed[kept]["mean_accepted_tokens"]
    for shape, row in timed.items():  # no EOS: 3 prompts x 9 tokens after the prefill's, for every shape
        assert row["tokens"] == 3 * 9 and 1.0 <= row["mean_accepted_tokens"] <= shape.depth + 1
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    # the static tree is tuned as for any drafter, beside it
    assert json.loads((eagle3 / "medusa_choices.json").read_text()) == result["medusa_choices"]
    out = capsys.readouterr().out
    assert "shortlisted dynamic tree" in out and "depth  topk  total  tokens/s" in out
    assert (f"kept the dynamic tree of depth {written['depth']}, topk {written['topk']}, total {written['total']} "
            "(the reference: depth 2, topk 4, total 3;") in out


def test_without_timed_prompts_the_reference_is_written_undecoded(exports):
    eagle3, _, prompts = exports
    result = _tune(eagle3, prompts, "dynamic_depths=[2,3]", "dynamic_topks=[2,4]", "timed_prompts=0")
    assert result["dynamic_tree"] == {"depth": 2, "topk": 4, "total": 3, "tokens_per_s": None,
                                      "mean_accepted_tokens": None,
                                      "chosen": {"by": "default", "reference": {"depth": 2, "topk": 4, "total": 3}}}
    assert json.loads((eagle3 / "dynamic_tree.json").read_text()) == result["dynamic_tree"]


def test_a_medusa_export_is_tuned_as_before_and_gets_no_dynamic_tree(exports):
    _, medusa, prompts = exports
    result = _tune(medusa, prompts, "timed_prompts=2")
    assert result["dynamic_tree"] is None and not (medusa / "dynamic_tree.json").exists()
    assert json.loads((medusa / "medusa_choices.json").read_text()) == result["medusa_choices"]


def test_the_decoder_built_from_the_export_decodes_over_its_tuned_dynamic_tree(exports):
    eagle3, medusa, _ = exports
    _write_shape(eagle3)
    decoder = TreeDecoder.from_pretrained(str(eagle3), dtype="float32")
    assert decoder.dynamic_tree == DynamicTree(**SHAPE)
    model, tokenizer = decoder.model, decoder.tokenizer
    ctx = BuildContext(model=model, tokenizer=tokenizer, export_dir=str(eagle3), dtype="float32")
    built = build_decoder("tree", decoder_settings("tree", {"acceptance": "greedy"}), ctx)
    assert built.decoder.dynamic_tree == DynamicTree(**SHAPE)
    assert built.info["tree_source"] == "export dynamic_tree.json" and built.info["dynamic_tree"] == SHAPE
    assert built.info["tree_nodes"] == 8
    for prompt in PROMPTS:  # fp32 greedy: the tokens of plain greedy decoding
        assert built.decoder.generate(prompt, DecodeConfig(max_new_tokens=24)).tokens == greedy(model.base, prompt, 24)
    # an explicit setting wins: a dynamic tree of its own, or a static tree
    mine = build_decoder("tree", decoder_settings("tree", {"dynamic_tree": {"depth": 2, "topk": 2,
                                                                                "total": 3}}), ctx)
    assert mine.decoder.dynamic_tree == DynamicTree(2, 2, 3)
    assert mine.info["tree_source"] == "decoder.tree.dynamic_tree"
    static = build_decoder("tree", decoder_settings("tree", {"medusa_choices": [[0], [0, 0]]}), ctx)
    assert static.decoder.dynamic_tree is None and static.info["tree_source"] == "decoder.tree.medusa_choices"
    assert TreeDecoder.from_pretrained(str(eagle3), dtype="float32",
                                       medusa_choices=[[0], [1]]).dynamic_tree is None
    # Medusa heads draft static trees only: a dynamic_tree.json beside them is not theirs to use
    _write_shape(medusa)
    medusa_decoder = TreeDecoder.from_pretrained(str(medusa), dtype="float32")
    assert medusa_decoder.dynamic_tree is None
    medusa_ctx = BuildContext(model=medusa_decoder.model, tokenizer=tokenizer, export_dir=str(medusa))
    assert build_decoder("tree", decoder_settings("tree", {}), medusa_ctx).decoder.dynamic_tree is None


@pytest.mark.parametrize("fields,message", [
    ({"total": 40}, r"dynamic_tree\.total=40 exceeds the 36 nodes a tree of depth 3 and topk 4 drafts"),
    ({"topk": 0}, r"dynamic_tree\.topk must be a positive int, got 0"),
    ({"depth": "3"}, r"dynamic_tree\.depth must be a positive int, got '3'"),
    ({"topk": 98, "total": 7}, r"dynamic_tree\.topk = 98 exceeds the drafter's vocabulary of 97"),
    ({"tokens_per_s": -1.0}, r"tokens_per_s = -1\.0 must be a finite number > 0 or null"),
    ({"chosen": [1]}, r"chosen must be an object"),
    ({"chosen": {"static_faster": "yes"}}, r"chosen\.static_faster must be true or false"),
])
def test_a_bad_dynamic_tree_json_is_refused_naming_the_file_and_field(exports, fields, message):
    eagle3, _, _ = exports
    _write_shape(eagle3, **fields)
    with pytest.raises(ValueError, match=rf"{eagle3}/dynamic_tree\.json: {message}"):
        TreeDecoder.from_pretrained(str(eagle3), dtype="float32")  # refused as the export loads


def test_a_dynamic_tree_json_without_a_field_or_not_an_object_is_refused(exports):
    eagle3, _, _ = exports
    (eagle3 / "dynamic_tree.json").write_text(json.dumps({"depth": 3, "topk": 4, "total": 7}))
    with pytest.raises(ValueError, match=r"dynamic_tree\.json has no \['tokens_per_s', 'mean_accepted_tokens', "
                                         r"'chosen'\]; run medusa-tune-tree again"):
        read_tree_files(eagle3)
    (eagle3 / "dynamic_tree.json").write_text("[3, 4, 7]")
    with pytest.raises(ValueError, match=r"dynamic_tree\.json must hold a JSON object, got list"):
        read_tree_files(eagle3)


def test_dynamic_tree_settings_are_refused_by_name_before_the_accuracy_pass(exports, monkeypatch):
    eagle3, medusa, prompts = exports
    with pytest.raises(ValueError, match=r"dynamic_topks\[1\] must be >= 1 .* got 0"):
        _tune(eagle3, prompts, "dynamic_topks=[2,0]")
    with pytest.raises(ValueError, match=r"dynamic_totals\[0\] = 9 exceeds max_nodes=7"):
        _tune(eagle3, prompts, "dynamic_totals=[9]")

    def no_measuring(*args, **kwargs):
        raise AssertionError("head accuracy measured before the dynamic tree's settings were checked")

    monkeypatch.setattr("inference.tuning.tune.measure_head_accuracy", no_measuring)
    with pytest.raises(ValueError, match="dynamic_depths is empty"):
        _tune(eagle3, prompts, "dynamic_depths=[]")
    with pytest.raises(ValueError, match=r"dynamic_topks\[0\] = 98 exceeds the drafter's vocabulary of 97"):
        _tune(eagle3, prompts, "dynamic_topks=[98]")
    with pytest.raises(ValueError, match=r"no total in \[7\] fits a dynamic tree of depth 2 and topk 2"):
        _tune(eagle3, prompts, "dynamic_depths=[2]", "dynamic_topks=[2]", "dynamic_totals=[7]")
    with pytest.raises(ValueError, match="dynamic_totals is empty"):
        _tune(eagle3, prompts, "dynamic_totals=[]")
    with pytest.raises(AssertionError, match="head accuracy measured"):  # unused for Medusa heads
        _tune(medusa, prompts, "dynamic_depths=[]")


def test_the_decoder_keeps_the_static_tree_when_it_decoded_faster_beyond_the_noise(exports):
    eagle3, _, _ = exports
    _write_shape(eagle3, chosen={"by": "timed", "static_faster": True})
    decoder = TreeDecoder.from_pretrained(str(eagle3), dtype="float32")
    assert decoder.dynamic_tree is None
    _write_shape(eagle3, chosen={"by": "timed", "static_faster": False})
    assert TreeDecoder.from_pretrained(str(eagle3), dtype="float32").dynamic_tree == DynamicTree(**SHAPE)


def test_the_tuner_records_the_dynamic_tree_against_the_static_one_on_the_same_prompts(exports, capsys):
    from inference.evaluation.intervals import ratio_interval
    from inference.tuning.dynamic import timed_table

    eagle3, _, prompts = exports
    result = _tune(eagle3, prompts, "dynamic_depths=[2,3]", "dynamic_topks=[2,4]", "timed_prompts=3")
    written = json.loads((eagle3 / "dynamic_tree.json").read_text())
    chosen, static = written["chosen"], result["chosen"]["timed"][str(len(result["medusa_choices"]) + 1)]
    row = timed_table(chosen)[DynamicTree(written["depth"], written["topk"], written["total"])]
    margin = ratio_interval(row["prompt_tokens"], row["prompt_seconds"], static["prompt_tokens"],
                            static["prompt_seconds"])
    assert chosen["over_static"] == {"static_nodes": len(result["medusa_choices"]), **margin.record()}
    assert chosen["static_faster"] == (margin.separated and margin.estimate < 1)
    assert "the dynamic tree ran" in capsys.readouterr().out
    decoder = TreeDecoder.from_pretrained(str(eagle3), dtype="float32")
    assert (decoder.dynamic_tree is None) == chosen["static_faster"]
