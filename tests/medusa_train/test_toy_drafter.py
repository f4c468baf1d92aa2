"""A new drafter type is one folder, one preset and one catalog entry (``docs/architecture.md``, "Adding a drafter").

The "repeat" drafter (:mod:`tests.toy_drafter`) is defined by the tests alone: registered for the test's duration, it
trains, exports, resumes, tunes and decodes exactly greedy through the real entry points, with no other file of the
project changed."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from medusa_train.catalog import registered, type_of
from medusa_train.paths import CONF_DIR
from tests.medusa_train.test_training import CrashAtStep, assert_same_heads, compose_train, tiny_overrides
from tests.medusa_train.test_training import write_tiny_inputs
from tests.toy_drafter import PRESETS, REPEAT
from tests.toy_drafter.heads import RepeatHeads


@pytest.fixture
def repeat_type():
    """The type registered and its preset's folder on Hydra's search path (``heads=repeat``), for one test."""
    with registered(REPEAT):
        yield f"hydra.searchpath=[file://{PRESETS}]"


def test_a_new_drafter_type_trains_exports_resumes_tunes_and_decodes_exactly_greedy(repeat_type, tmp_path):
    from inference.decoders.base import DecodeConfig
    from inference.decoders.tree import TreeDecoder
    from inference.decoders.vanilla import VanillaDecoder
    from inference.cli.tune_tree import register_schemas, run as tune
    from medusa_train.export import load_heads, read_export_config
    from medusa_train.training.recipe import build_recipe

    model_dir, data = write_tiny_inputs(tmp_path)
    overrides = [repeat_type, "heads=repeat", "heads.target=base_argmax"]
    run = tmp_path / "run"
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run) + overrides))
    recipe.run()
    export = run / "export"
    config = read_export_config(export)
    assert config["head_type"] == "repeat" and config["repeat_num_heads"] == 2 and "medusa_num_heads" not in config
    assert (export / "repeat_heads.safetensors").is_file() and not (export / "medusa_lm_head.safetensors").exists()
    heads, _ = load_heads(export)
    assert type(heads) is RepeatHeads and type_of(heads) is REPEAT and heads.spec.num_heads == 2
    assert heads.bias.abs().sum() > 0  # it trained: the biases started at zero

    # a crashed run of the type resumes to the same heads
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, crashed) + overrides), callbacks=[CrashAtStep(6)]).run()
    build_recipe(compose_train(tiny_overrides(model_dir, data, crashed, resume="true") + overrides)).run()
    from safetensors.torch import load_file
    assert_same_heads(load_file(str(export / "repeat_heads.safetensors")),
                      load_file(str(crashed / "export" / "repeat_heads.safetensors")))

    # medusa-tune-tree measures its heads and writes a tree for them
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                 for i, t in enumerate(["count from one", "count from five", "abc"])) + "\n")
    register_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("tune_tree", overrides=[f"export_dir={export}", "prompts.source=jsonl", f"prompts.path={prompts}",
                                              "max_new_tokens=12", "topk=3", "latency_sizes=[1,4]",
                                              "context_length=16", "repeats=1", "max_nodes=3",
                                              "timed_new_tokens=8", "dtype=float32"])
    result = tune(cfg)
    choices = json.loads((export / "medusa_choices.json").read_text())
    assert choices == result["medusa_choices"] and 1 <= len(choices) <= 3
    assert len(json.loads((export / "head_accuracy.json").read_text())["acc"]) == 2

    # the tree decoder runs it from the export, greedy output identical to plain greedy decoding (fp32)
    decoder = TreeDecoder.from_pretrained(str(export), dtype="float32")
    assert type(decoder.model.heads) is RepeatHeads and decoder.model.head_type == "repeat"
    vanilla = VanillaDecoder(decoder.model.base)
    request = DecodeConfig(max_new_tokens=24)
    for prompt in ([1, 5, 9, 13], [7, 7, 7, 7, 7, 7], [300, 2, 44]):
        assert decoder.generate(prompt, request).tokens == vanilla.generate(prompt, request).tokens


def test_a_registered_type_is_refused_where_it_cannot_go(repeat_type, tmp_path):
    model_dir, data = write_tiny_inputs(tmp_path)
    cfg = compose_train(tiny_overrides(model_dir, data, tmp_path / "run") + [repeat_type, "heads=repeat",
                                                                               "heads.mode=joint"])
    from medusa_train.config import TrainConfig, as_dataclass

    with pytest.raises(ValueError, match=r"heads.head_type=repeat trains the heads on a frozen base.*for Medusa heads"):
        as_dataclass(TrainConfig, cfg)
    with pytest.raises(ValueError, match=r"heads.combine=sum is for Hydra heads, not Repeat heads"):
        as_dataclass(TrainConfig, compose_train(tiny_overrides(model_dir, data, tmp_path / "run")
                                      + [repeat_type, "heads=repeat", "heads.combine=sum"]))
