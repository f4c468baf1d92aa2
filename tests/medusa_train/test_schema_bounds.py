"""Every numeric setting of every config schema has its range checked before any model loads.

The walk covers each schema Hydra's ConfigStore holds once every console script registered its own (plus the two
validated through ``as_dataclass`` without being stored: ``draft/`` and ``medusa-publish``'s), recursing into nested
schemas. Each int or float field must declare a bound (``medusa_train.config.bounds``); zero, a negative, a huge value and
(for floats) NaN are tried through the function each entry point validates with, and every value the bound refuses
must be refused naming the dotted field. The concrete cases of issue 27 then run through the real composition of
``conf/*.yaml`` with the model loader replaced by one that fails the test if it is reached."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import math
import re
import tomllib
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from inference.cli.generate import GenerateConfig
from inference.draft_loading import DraftConfig
from inference.evaluation.eval_config import EvaluateConfig
from inference.registry import REGISTRY, decoder_settings
from inference.tuning.tune_tree_config import TuneTreeConfig
from medusa_train.config.bounds import field_bound, optional_fields
from medusa_train.cli.export_gguf import ExportGgufConfig
from medusa_train.config.schema import DataConfig, as_dataclass, train_schema
from inference.conf import CONF_DIR as INFERENCE_CONF_DIR
from medusa_train.files.paths import CONF_DIR, REPO_ROOT
from medusa_train.publish.publish_config import PublishConfig
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.inference.test_tune_tree import tiny_export  # noqa: F401 (a fixture: a 3-head export of a tiny Llama)

PROBES = (0, -1, -3, 10**12)
FLOAT_PROBES = (0.0, -1.0, 1e12, math.nan, math.inf)


def register_every_entry_point() -> None:
    scripts = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module = importlib.import_module(target.split(":")[0])
        if hasattr(module, "register_schemas"):
            module.register_schemas()


register_every_entry_point()


def stored_schemas() -> set[type]:
    """The dataclasses stored in Hydra's ConfigStore (Hydra's own settings left out)."""
    found: set[type] = set()

    def walk(repo: dict) -> None:
        for value in repo.values():
            if isinstance(value, dict):
                walk(value)
                continue
            kind = OmegaConf.get_type(value.node)
            if dataclasses.is_dataclass(kind) and not kind.__module__.startswith("hydra."):
                found.add(kind)

    walk(ConfigStore.instance().repo)
    return found


def numeric_fields(cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], type, dataclasses.Field]]:
    """(path, number type, field) of every int/float field (or list of them) of ``cls``, nested schemas included."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[X]
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        if kind in (int, float):
            out.append(((*path, f.name), kind, f))
        elif dataclasses.is_dataclass(kind):
            out += numeric_fields(kind, (*path, f.name))
    return out


def nested_schemas(cls: type) -> set[type]:
    hints = typing.get_type_hints(cls)
    inner = {hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}
    return {cls}.union(*(nested_schemas(c) for c in inner))


def compose_conf(name: str, overrides: list[str]):
    conf = INFERENCE_CONF_DIR if (INFERENCE_CONF_DIR / f"{name}.yaml").is_file() else CONF_DIR  # its command's folder
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose(name, overrides=overrides)


# --- the schemas and how each entry point validates them ---------------------------------------------------------

ROOTS: dict[str, type] = {"train": train_schema(), "tune_tree": TuneTreeConfig, "evaluate": EvaluateConfig,
                          "generate": GenerateConfig, "draft": DraftConfig, "publish": PublishConfig,
                          "export_gguf": ExportGgufConfig,
                          **{f"decoder.{name}": entry.settings for name, entry in REGISTRY.items()}}


def valid_values(root: str, tmp_path: Path) -> dict:
    """A complete, valid config of ``root`` as a plain dict (composed from ``conf/`` where it has a primary file)."""
    composed = {
        "train": lambda: compose_conf("train", [f"output_dir={tmp_path}"]),
        "tune_tree": lambda: compose_conf("tune_tree", [f"export_dir={tmp_path}"]),
        "evaluate": lambda: compose_conf("evaluate", [f"export_dir={tmp_path}", f"output_dir={tmp_path}/out"]),
        "generate": lambda: compose_conf("generate", [f"export_dir={tmp_path}", "prompt=hi"]),
    }
    if root == "tune_tree":
        (tmp_path / "config.json").write_text("{}")  # an export folder, as far as the settings are concerned
    if root in composed:
        values = OmegaConf.to_container(composed[root](), resolve=True)
        values.pop("hydra", None)
        return values
    if root == "publish":
        return {"export_dir": str(tmp_path), "dry_run": True, "output_dir": str(tmp_path / "out")}
    return {}  # the decoders' settings and draft/: every field has a valid default


def validate(root: str, values: dict) -> None:
    """What the entry point of ``root`` runs on its settings before loading anything."""
    if root.startswith("decoder."):
        decoder_settings(root.removeprefix("decoder."), values)
    else:
        as_dataclass(ROOTS[root], values)


def dotted(root: str, path: tuple[str, ...]) -> str:
    return ".".join(((root,) if root.startswith(("decoder.", "draft")) else ()) + path)


FIELDS = [(root, path, kind, f) for root, cls in ROOTS.items() for path, kind, f in numeric_fields(cls)]


def test_every_stored_schema_is_walked():
    walked = set().union(*(nested_schemas(cls) for cls in ROOTS.values()))
    assert {"TrainConfig", "TuneTreeConfig", "GenerateConfig", "TreeSettings"} <= {c.__name__ for c in walked}
    assert stored_schemas() - walked == set(), "a schema stored in the ConfigStore is missing from ROOTS"
    assert len(FIELDS) >= 80  # TrainConfig alone has 37


def test_every_numeric_field_declares_its_bound():
    missing = [dotted(root, path) for root, path, _, f in FIELDS if field_bound(f) is None]
    assert missing == [], f"numeric settings without a bound (metadata=bound(...) or unbounded(reason)): {missing}"


def test_no_setting_takes_negative_or_huge_counts_or_nan():
    """What every bound declared so far refuses: -3 everywhere, 10**12 for every int, NaN for every float."""
    for root, path, kind, f in FIELDS:
        rule = field_bound(f)
        assert not rule.admits(-3), dotted(root, path)
        assert kind is float or not rule.admits(10**12), dotted(root, path)
        assert not rule.admits(math.nan), dotted(root, path)


@pytest.mark.parametrize(("root", "path", "kind", "f"), FIELDS, ids=[dotted(r, p) for r, p, _, _ in FIELDS])
def test_each_refused_value_is_refused_by_name_before_loading(root, path, kind, f, tmp_path):
    base = valid_values(root, tmp_path)
    validate(root, copy.deepcopy(base))  # the composed defaults pass
    rule = field_bound(f)
    owner = owner_class(root, path)
    optional = path[-1] in optional_fields(owner)
    as_list = typing.get_origin(typing.get_type_hints(owner)[path[-1]]) is list
    refused = 0
    for value in PROBES if kind is int else FLOAT_PROBES:
        if rule.admits(value, optional):
            continue
        values = copy.deepcopy(base)
        node = values
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = [1, value] if as_list else value
        with pytest.raises(ValueError, match=re.escape(dotted(root, path))):
            validate(root, values)
        refused += 1
    assert refused >= 2  # at least the negative and NaN or the huge count


def owner_class(root: str, path: tuple[str, ...]) -> type:
    """The dataclass that holds the field at ``path``."""
    cls = ROOTS[root]
    for key in path[:-1]:
        cls = typing.get_type_hints(cls)[key]
    return cls


# --- the cases of issue 27, through the real composition -----------------------------------------------------------


@pytest.fixture
def loaders_fail(monkeypatch):
    """Every model loader replaced by one that fails the test: the error must come before any model loads."""
    import medusa_train.loading.runtime as runtime
    import medusa_train.training.base_recipe as base_recipe
    import medusa_train.training.joint_recipe as joint_recipe

    def reached(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad setting was refused")

    for module, name in ((base_recipe, "load_base_model"), (joint_recipe, "load_base_model"),
                         (runtime, "load_for_inference")):
        monkeypatch.setattr(module, name, reached)


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.adam_beta1=1.5", "trainer.adam_beta1 must be in [0, 1), got 1.5"),
    ("trainer.adam_beta2=-0.5", "trainer.adam_beta2 must be in [0, 1), got -0.5"),
    ("trainer.dataloader_num_workers=-1", "trainer.dataloader_num_workers must be >= 0"),
    ("trainer.weight_decay=-1", "trainer.weight_decay must be >= 0, got -1"),
    ("trainer.max_grad_norm=-1", "trainer.max_grad_norm must be >= 0 (0: no clipping), got -1"),
    ("trainer.save_total_limit=0", "trainer.save_total_limit must be >= 1 or null"),
    ("trainer.learning_rate=nan", "trainer.learning_rate must be a finite number, got nan"),
    ("trainer.max_steps=1000000000000", "trainer.max_steps must be at most 2147483647"),
    ("data.max_new_tokens=1000000000000", "data.max_new_tokens must be at most 1048576"),
    ("data.max_new_tokens=512", "data.max_new_tokens=512 must be below max_length=512"),
    ("heads.lora.r=0", "heads.lora.r must be >= 1, got 0"),
    ("seed=-1", "seed must be in [0, 4294967295], got -1"),
    ("model.device=mps", "model.device must be one of cpu, cuda, cuda:N, auto (N: a GPU index; mps and tpu are not"),
    ("model.device=tpu", "(N: a GPU index; mps and tpu are not supported), got 'tpu'"),
])
def test_medusa_train_refuses_before_loading_or_touching_the_run(override, message, tmp_path, loaders_fail):
    from medusa_train.cli.train import train

    out = tmp_path / "run"
    old = {out / "export" / "config.json": "{}", out / "checkpoints" / "checkpoint-4" / "trainer_state.json": "{}"}
    for path, text in old.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(compose_conf("train", [f"output_dir={out}", override]))  # data=stories260k_selfdistill: self_distill
    assert {p: p.read_text() for p in old} == old and sorted(p.name for p in out.iterdir()) == ["checkpoints", "export"]


@pytest.mark.parametrize(("override", "message"), [
    ("repeats=0", "repeats must be >= 1, got 0"),
    ("context_length=0", "context_length must be >= 1, got 0"),
    ("context_length=-5", "context_length must be >= 1, got -5"),
    ("max_new_tokens=1000000000000", "max_new_tokens must be at most 1048576"),
    ("timed_new_tokens=1000000000000", "timed_new_tokens must be at most 1048576"),
    ("prompts.offset=-3", "prompts.offset must be >= 0 or null, got -3"),
    ("prompts.num_prompts=0", "prompts.num_prompts must be >= 1, got 0"),
    ("latency_sizes=[1,0]", "latency_sizes[1] must be >= 1"),
    ("context_length=1048576", "context_length + max(latency_sizes) = 1048640 exceeds the hard cap"),
    ("device=mps", "device must be one of cpu, cuda, cuda:N, auto"),
])
def test_tune_tree_refuses_before_loading(override, message, tmp_path, loaders_fail):
    from inference.cli.tune_tree import run

    with pytest.raises(ValueError, match=re.escape(message)):
        run(compose_conf("tune_tree", [f"export_dir={tmp_path}", override]))


@pytest.mark.parametrize(("override", "message"), [
    ("max_new_tokens=2048", "max_new_tokens=2048 does not fit the model's context of 2048 positions"),
    ("timed_new_tokens=4096", "timed_new_tokens=4096 does not fit the model's context of 2048"),
    ("context_length=2000", "context_length=2000 + max(latency_sizes)=64 exceeds the model's context of 2048 "
                            "positions: set context_length to at most 1984"),
])
def test_tune_tree_refuses_lengths_beyond_the_models_context_before_the_accuracy_pass(tiny_export, override, message,
                                                                                       monkeypatch):
    from inference.cli.tune_tree import run
    import inference.tuning.tune as tune

    def measured(*args, **kwargs):
        raise AssertionError("the accuracy pass ran before the lengths were checked against the model")

    monkeypatch.setattr(tune, "measure_head_accuracy", measured)
    export, prompts = tiny_export  # a tiny Llama: max_position_embeddings 2048
    with pytest.raises(ValueError, match=re.escape(message)):
        run(compose_conf("tune_tree", [f"export_dir={export}", "prompts.source=jsonl", f"prompts.path={prompts}",
                                       "dtype=float32", override]))


@pytest.mark.parametrize(("overrides", "message"), [
    (["noise_positions=-1"], "noise_positions must be >= 0 (0 skips the measurement), got -1"),
    (["prompt_offset=-3"], "prompt_offset must be >= 0 or null, got -3"),
    (["max_new_tokens=1000000000000"], "max_new_tokens must be at most 1048576"),
    (["top_p=nan"], "top_p must be a finite number"),
    (["warmup=-1"], "warmup must be >= 0, got -1"),
    (["decoder.lookahead.window=0"], "decoder.lookahead.window must be >= 1 (W, lookahead window size), got 0"),
    (["decoders=[vllm]", "decoder.vllm.max_model_len=0"], "decoder.vllm.max_model_len must be >= 1, got 0"),
    (["decoder.tree.posterior_alpha=inf"], "decoder.tree.posterior_alpha must be a finite number"),
    (["device=tpu"], "device must be one of cpu, cuda, cuda:N, auto"),
])
def test_medusa_eval_refuses_before_loading(overrides, message, tmp_path, loaders_fail):
    from inference.evaluation.eval_run import evaluate

    with pytest.raises(ValueError, match=re.escape(message)):
        evaluate(compose_conf("evaluate", [f"export_dir={tmp_path}", f"output_dir={tmp_path}/out", *overrides]))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    (["max_new_tokens=1000000000000"], "max_new_tokens must be at most 1048576"),
    (["seed=-1"], "seed must be in [0, 4294967295] or null (null: random), got -1"),
    (["temperature=inf"], "temperature must be a finite number"),
    (["decoder.tree.topk=0"], "decoder.tree.topk must be >= 1, got 0"),
    (["device=mps"], "device must be one of cpu, cuda, cuda:N, auto"),
])
def test_medusa_generate_refuses_before_loading(overrides, message, tmp_path, loaders_fail):
    from inference.cli.generate import run

    with pytest.raises(ValueError, match=re.escape(message)):
        run(compose_conf("generate", [f"export_dir={tmp_path}", "prompt=hi", *overrides]))


def test_self_distillation_longer_than_the_models_context_is_refused_before_generating(tmp_path, monkeypatch):
    import medusa_train.training.data_prep as data_prep

    def generated(*args, **kwargs):
        raise AssertionError("self-distillation started with replies longer than the model's context")

    monkeypatch.setattr(data_prep, "self_distill", generated)
    data = DataConfig(source="prompts", prompts=["hello"], self_distill=True, max_new_tokens=64)
    model = make_tiny_model("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match=re.escape("data.max_new_tokens=64 does not fit the base model's context of "
                                                   "64 positions (with a prompt of at least one token): set "
                                                   "data.max_new_tokens to at most 63")):
        data_prep.prepare_data(data, tokenizer=make_tiny_tokenizer(), model=model, max_length=512, seed=0,
                               self_distill_dir=tmp_path, rank=0, world_size=1, barrier=lambda: None)
    DataConfig(source="prompts", prompts=["hello"], self_distill=True, max_new_tokens=63).check_context(64)
