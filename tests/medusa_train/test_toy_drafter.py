"""A new drafter type is one folder, one preset and one catalog line (``docs/architecture.md``, "Adding a drafter").

The "repeat" drafter (:mod:`tests.toy_drafter`) is defined by the tests alone: its package added to the catalog's
modules for the test's duration (the one catalog line) and its preset on Hydra's search path, it is found the way the
built-in types are (the catalog imports its package on the first lookup), and it trains with its own option, exports
its engine files, resumes, tunes, decodes exactly greedy and is served by a fake engine through its own engine decoder
and vLLM mapping, through the real entry points, with no other file of the project changed."""

from __future__ import annotations

import json
import sys

import pytest
from hydra import compose, initialize_config_dir

from medusa_train.models import catalog
from inference.conf import CONF_DIR
from tests.medusa_train.test_training import CrashAtStep, assert_same_heads, compose_train, tiny_overrides
from tests.medusa_train.test_training import write_tiny_inputs

TOY = "tests.toy_drafter"


def forget_toy() -> None:
    """Unregister the type and drop its modules, so that the next test finds it again by importing its package."""
    catalog.unregister("repeat")
    for name in [m for m in sys.modules if m == TOY or m.startswith(TOY + ".")]:
        del sys.modules[name]


@pytest.fixture
def repeat_type(monkeypatch):
    """The toy's package among the catalog's modules (the one catalog line), the catalog not yet loaded, the schemas
    registered as an entry point registers them (the heads schema then holds ``heads.scale``) and its preset's folder
    on Hydra's search path (``heads=repeat``), for one test."""
    from inference.registry import sync_drafter_decoders
    from medusa_train.cli.app import register_shared_schemas

    forget_toy()
    monkeypatch.setattr(catalog, "BUILTIN_MODULES", (*catalog.BUILTIN_MODULES, TOY))
    monkeypatch.setattr(catalog, "_loaded", False)
    register_shared_schemas()
    from tests.toy_drafter import PRESETS  # found above, by the catalog, not by this import

    yield f"hydra.searchpath=[file://{PRESETS}]"
    forget_toy()
    register_shared_schemas()  # the schemas without it
    sync_drafter_decoders()


def test_the_toy_is_found_as_the_built_in_types_are(repeat_type):
    from inference.registry import REGISTRY, decoder_names
    from medusa_train.config.schema import heads_schema

    entry = catalog.drafter_type("repeat")
    assert catalog.head_types()[-1] == "repeat" and entry.module_cls.__module__ == f"{TOY}.heads"
    assert "scale" in {f.name for f in __import__("dataclasses").fields(heads_schema())}
    assert "vllm_repeat" in decoder_names() and REGISTRY["vllm_repeat"].engine == "vllm"
    assert catalog.vllm_drafter_type("repeat") is entry


def test_a_new_drafter_type_trains_exports_resumes_tunes_decodes_exactly_greedy_and_is_served(repeat_type, tmp_path,
                                                                                            monkeypatch):
    from safetensors.torch import load_file

    from inference.cli.tune_tree import register_schemas, run as tune
    from inference.decoders.base import DecodeConfig
    from inference.decoders.tree import TreeDecoder
    from inference.decoders.vanilla import VanillaDecoder
    from inference.registry import BuildContext, build_decoder, decoder_settings
    from medusa_train.config.schema import ModelConfig
    from medusa_train.export import load_heads, read_export_config
    from medusa_train.training.recipe import build_recipe
    from tests.toy_drafter import fake_engine
    from tests.toy_drafter.heads import RepeatHeads

    model_dir, data = write_tiny_inputs(tmp_path)
    overrides = [repeat_type, "heads=repeat", "heads.target=base_argmax"]
    run = tmp_path / "run"
    build_recipe(compose_train(tiny_overrides(model_dir, data, run, export_vllm="true") + overrides)).run()
    export = run / "export"
    config = read_export_config(export)
    assert config["head_type"] == "repeat" and config["repeat_num_heads"] == 2 and "medusa_num_heads" not in config
    assert config["repeat_scale"] == 2.0  # its own option, from its preset, recorded by its own key
    assert (export / "repeat_heads.safetensors").is_file() and not (export / "medusa_lm_head.safetensors").exists()
    assert json.loads((export / "repeat_vllm" / "config.json").read_text())["scale"] == 2.0  # its engine files
    heads, _ = load_heads(export)
    assert type(heads) is RepeatHeads and catalog.type_of(heads).name == "repeat" and heads.spec.scale == 2.0
    assert heads.bias.abs().sum() > 0  # it trained: the biases started at zero

    # a crashed run of the type resumes to the same heads
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, crashed) + overrides), callbacks=[CrashAtStep(6)]).run()
    build_recipe(compose_train(tiny_overrides(model_dir, data, crashed, resume="true") + overrides)).run()
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
    prompts_ids = ([1, 5, 9, 13], [7, 7, 7, 7, 7, 7], [300, 2, 44])
    for prompt in prompts_ids:
        assert decoder.generate(prompt, request).tokens == vanilla.generate(prompt, request).tokens

    # its engine decoder (declared in its folder) is built by the registry's vLLM builder and served by the fake
    # engine with the speculative config of its own vLLM mapping: greedy replies, as a lossless engine gives
    monkeypatch.setattr("medusa_train.engines.vllm_env.VllmWorker", fake_engine.FakeVllmWorker)
    ctx = BuildContext(model=decoder.model, tokenizer=None, export_dir=str(export),
                       model_config=ModelConfig(name_or_path=str(model_dir)))
    built = build_decoder("vllm_repeat", decoder_settings("vllm_repeat", {"num_speculative_tokens": 1}), ctx)
    engine = fake_engine.STARTED[-1]
    assert built.info["speculative_config"] == {"method": "repeat", "model": str((export / "repeat_vllm").resolve()),
                                                "num_speculative_tokens": 1}
    assert engine.model == str(model_dir) and built.decoder.name == "vllm_repeat"
    for prompt in prompts_ids:
        assert built.decoder.generate(prompt, request).tokens == vanilla.generate(prompt, request).tokens
    built.decoder.close()
    assert engine.closed


def test_a_registered_type_is_refused_where_it_cannot_go(repeat_type, tmp_path):
    from medusa_train.config.schema import TrainConfig, as_dataclass

    model_dir, data = write_tiny_inputs(tmp_path)

    def refused(*extra: str) -> None:
        as_dataclass(TrainConfig, compose_train(tiny_overrides(model_dir, data, tmp_path / "run")
                                                + [repeat_type, "heads=repeat", *extra]))

    with pytest.raises(ValueError, match=r"heads.head_type=repeat trains the heads on a frozen base.*for Medusa heads"):
        refused("heads.mode=joint")
    with pytest.raises(ValueError, match=r"heads.combine=sum is for Hydra heads, not Repeat heads"):
        refused("heads.combine=sum")
    with pytest.raises(ValueError, match=r"heads.scale must be > 0"):  # its option's bound
        refused("heads.scale=0")
    with pytest.raises(ValueError, match=r"heads.scale=3.0 scales the repeat heads' own projection"):  # its check
        refused("heads.scale=3", "heads.share_lm_head=true")
    with pytest.raises(ValueError, match=r"heads.scale=3.0 is for Repeat heads, not Medusa heads"):
        as_dataclass(TrainConfig, compose_train(tiny_overrides(model_dir, data, tmp_path / "run") + ["heads.scale=3"]))
