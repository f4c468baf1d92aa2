"""Every YAML under conf/ composes (subfolders included), the training configs validate against TrainConfig, and a
misspelt key fails at composition with Hydra's message."""

from __future__ import annotations

import importlib
import shutil
import tomllib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from inference.conf import CONF_DIR as INFERENCE_CONF_DIR
from inference.conf import SHARED_CONF
from medusa_train.config.schema import TrainConfig, as_dataclass
from medusa_train.files.paths import CONF_DIR, REPO_ROOT
from medusa_train.training.arguments import load_deepspeed_config

CONF_DIRS = {"medusa_train": CONF_DIR, "inference": INFERENCE_CONF_DIR}  # each package's presets
PRIMARY = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
# "package:path" of every file under either conf/ folder (a primary config: no folder in its path)
CONF_FILES = sorted(f"{package}:{p.relative_to(conf).with_suffix('')}" for package, conf in CONF_DIRS.items()
                    for p in conf.glob("**/*.yaml"))
GROUP_FILES = [f for f in CONF_FILES if "/" in f]
TRAIN_GROUPS = ("model", "heads", "data", "trainer", "logger")
TRAIN_OPTIONS = [(g, p.stem) for g in TRAIN_GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


@pytest.fixture(scope="module", autouse=True)
def entry_points_registered():
    """Register, as every console script does before composing, the schemas its primary config extends (each
    script's module has a ``register_schemas``; importing it registers nothing)."""
    scripts = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text())["project"]["scripts"]
    for target in scripts.values():
        module = target.split(":")[0]
        try:
            importlib.import_module(module).register_schemas()
        except ModuleNotFoundError as e:
            if e.name != module:  # the script's own module may not be written yet; anything else is a real error
                raise


def compose_in(conf_dir: Path, name: str, overrides: list[str] | None = None):
    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        return compose(name, overrides=overrides or [])


def compose_file(package_path: str):
    """A ``package:path`` of :data:`CONF_FILES` composed in its package's folder; ``inference``'s group files with
    ``medusa_train``'s presets on the search path, as its primary configs put them (a group file sets no searchpath)."""
    package, path = package_path.split(":")
    extra = [f"hydra.searchpath=[{SHARED_CONF}]"] if package == "inference" and "/" in path else []
    return compose_in(CONF_DIRS[package], path, extra)


def resolved_or_skip(cfg) -> dict:
    """The config with interpolations resolved; skip when it points at a package that is not installed here."""
    from medusa_train.cli.app import resolver_error

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        missing = resolver_error(e, FileNotFoundError)  # a model not installed yet, too (NotInstalledError)
        if missing is not None:
            pytest.skip(f"needs a file or package not present here: {missing}")
        raise


def test_the_conf_folder_holds_the_training_groups():
    assert "train" in PRIMARY
    for group in TRAIN_GROUPS:
        assert list((CONF_DIR / group).glob("*.yaml")), group
    assert {"cpu", "ddp", "deepspeed_zero2", "deepspeed_zero3"} <= {p.stem for p in (CONF_DIR / "trainer").glob("*")}
    assert {"wandb", "none"} <= {p.stem for p in (CONF_DIR / "logger").glob("*")}


@pytest.mark.parametrize("path", [f for f in CONF_FILES if "/" not in f])
def test_every_primary_config_composes(path):
    cfg = compose_file(path)
    assert len(cfg) > 0


@pytest.mark.parametrize("path", GROUP_FILES)
def test_every_group_file_composes_on_its_own(path):
    cfg = compose_file(path)
    assert OmegaConf.is_config(cfg)


def test_inference_presets_live_beside_inference():
    assert {"evaluate", "generate", "tune_tree"} <= {p.stem for p in INFERENCE_CONF_DIR.glob("*.yaml")}
    assert {"decoder", "draft"} <= {p.name for p in INFERENCE_CONF_DIR.iterdir() if p.is_dir()}
    assert not {"evaluate", "generate", "tune_tree", "decoder", "draft"} & {p.stem for p in CONF_DIR.iterdir()}
    for name in ("evaluate", "generate", "tune_tree"):  # model/ and the schemas are found in medusa_train/conf
        assert OmegaConf.load(INFERENCE_CONF_DIR / f"{name}.yaml").hydra.searchpath == [SHARED_CONF]


@pytest.mark.parametrize(("group", "option"), TRAIN_OPTIONS, ids=[f"{g}={o}" for g, o in TRAIN_OPTIONS])
def test_every_training_option_validates_as_a_train_config(group, option, tmp_path):
    overrides = [f"{group}={option}", f"output_dir={tmp_path}"]
    if group == "data" and option == "json":
        overrides.append("data.path=conversations.jsonl")  # the one required value (???)
    cfg = compose_in(CONF_DIR, "train", overrides)
    resolved = resolved_or_skip(cfg)
    train = as_dataclass(TrainConfig, resolved)
    assert getattr(train, group) is not None
    if group == "trainer" and train.trainer.deepspeed:
        stage = load_deepspeed_config(train.trainer.deepspeed)["zero_optimization"]["stage"]
        assert stage == int(option[-1])


def test_the_documented_command_line_composes():
    cfg = compose_in(CONF_DIR, "train", ["model=smollm2_135m", "data=sharegpt", "trainer=ddp"])
    train = as_dataclass(TrainConfig, resolved_or_skip(cfg))
    assert (train.model.format, train.data.source, train.trainer.strategy) == ("gguf", "sharegpt", "ddp")
    assert train.heads.mode == "frozen_base" and train.logger.report_to == []
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        hydra_cfg = compose("train", overrides=["output_dir=/runs/x"], return_hydra_config=True).hydra
    assert hydra_cfg.run.dir == "/runs/x/hydra"  # every rank under torchrun writes into one folder


@pytest.mark.parametrize("override", ["trainer.learnin_rate=0.1", "bogus=1", "heads.medusa_num_head=3"])
def test_a_misspelt_override_fails_at_composition(override):
    with pytest.raises(ConfigCompositionException, match="Could not override"):
        compose_in(CONF_DIR, "train", [override])


def test_a_misspelt_key_in_a_yaml_file_fails_at_composition(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "data" / "typo.yaml").write_text(
        "defaults:\n  - /schema/data/base@_here_\n  - _self_\nsoruce: json\npath: x.jsonl\n"
    )
    with pytest.raises(ConfigCompositionException, match="ConfigKeyError.*\n.*Key 'soruce' not in 'DataConfig'"):
        compose_in(conf, "train", ["data=typo"])


def test_wrong_types_and_bad_values_fail_before_anything_runs(tmp_path):
    with pytest.raises(ConfigCompositionException, match="trainer.max_steps"):
        compose_in(CONF_DIR, "train", ["trainer.max_steps=many"])
    cfg = compose_in(CONF_DIR, "train", ["trainer.precision=fp8", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="trainer.precision must be one of"):
        as_dataclass(TrainConfig, OmegaConf.to_container(cfg, resolve=True))
    cfg = compose_in(CONF_DIR, "train", ["trainer=deepspeed_zero2", "trainer.strategy=ddp", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="use strategy=deepspeed"):
        as_dataclass(TrainConfig, OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "heads").glob("*.yaml")))
def test_heads_presets_set_only_what_differs_from_the_schema(preset):
    """Each default is defined once, in the heads schema: a preset sets its mode and the fields it changes."""
    import dataclasses

    from medusa_train.config.schema import HeadsConfig

    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "heads" / f"{preset}.yaml"))
    values.pop("defaults")
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(HeadsConfig)}
    restated = {k: v for k, v in values.items() if k != "mode" and v == defaults[k]}
    assert not restated, f"conf/heads/{preset}.yaml restates schema defaults: {restated}"
    assert set(values) <= set(defaults)


def extended_schema(path: Path) -> type | None:
    """The dataclass a ``conf/`` file extends through its defaults list (a schema stored in Hydra's ConfigStore by
    the entry points), or None when it extends none."""
    from hydra.core.config_store import ConfigStore
    from hydra.plugins.config_source import ConfigLoadError

    for entry in OmegaConf.load(path).get("defaults", []):
        if not isinstance(entry, str) or entry == "_self_":
            continue
        try:
            node = ConfigStore.instance().load(entry.split("@")[0].lstrip("/") + ".yaml").node
        except ConfigLoadError:
            continue  # another conf/ file (a group option), not a schema
        return OmegaConf.get_type(node)
    return None


@pytest.mark.parametrize("path", CONF_FILES)
def test_every_conf_file_sets_only_what_differs_from_its_schema(path):
    """Each default is defined once, in its dataclass schema: every file under conf/ extends its schema and sets
    only the keys whose value differs from the schema's default, so changing a default changes every shipped run.
    Kept besides: required keys (``???``), interpolations, and a preset's own name (data/sharegpt's ``source``,
    draft/self_layers's ``kind``: it stays that preset whatever the default)."""
    package, path = path.split(":")
    file = CONF_DIRS[package] / f"{path}.yaml"
    schema = extended_schema(file)
    assert schema is not None, f"conf/{path}.yaml extends no schema in its defaults list"
    defaults = OmegaConf.structured(schema)
    values = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    restated = {}
    for key, value in values.items():
        if key in ("defaults", "hydra") or value == "???" or (isinstance(value, str) and "${" in value):
            continue
        if value == Path(path).name:
            continue
        as_set = OmegaConf.merge(defaults, {key: value})  # the value as the schema types it (1.0e-3, 2 -> 2.0)
        if OmegaConf.to_container(as_set, resolve=False)[key] == OmegaConf.to_container(defaults, resolve=False)[key]:
            restated[key] = value
    assert not restated, f"conf/{path}.yaml restates {schema.__name__}'s defaults: {restated}"


def test_every_heads_mode_has_its_recipe():
    """heads.mode is checked once, by the schema; the recipes are keyed by the same modes."""
    from medusa_train.config.schema import HEADS_MODES
    from medusa_train.training.recipe import RECIPES

    assert tuple(RECIPES) == HEADS_MODES == ("frozen_base", "joint")
