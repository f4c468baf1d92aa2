"""The drafter catalog: no module but a drafter's own folder and the catalog compares a drafter type's name or tests
its class, and every registered type trains, exports, resumes and tunes through it. A new type is one folder, one
preset and one catalog entry: the toy drafter of ``tests/toy_drafter/`` (``tests/medusa_train/test_toy_drafter.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from medusa_train.models.catalog import drafter_type, drafter_types, head_types, type_of
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.files.paths import CONF_DIR, PACKAGE_DIR
from tests.medusa_train.test_training import CrashAtStep, assert_same_heads, compose_train, tiny_overrides
from tests.medusa_train.test_training import write_tiny_inputs

ROOT = PACKAGE_DIR.parent
# The places that may name a drafter type: the catalog and each type's own folder.
OWN_MODULES = {"medusa_train/models/catalog.py"}
OWN_FOLDER = "medusa_train/drafters/"
# Lines outside those places allowed to match anyway, each with its reason: none.
ALLOWED: dict[str, str] = {}
# Dispatch on a type by name or class, anywhere else, is what the catalog replaces.
DISPATCH = [
    re.compile(r"head_type\s*[!=]=\s*['\"]"),
    re.compile(r"['\"](medusa|hydra)['\"]\s*[!=]=\s*[\w.]*head_type"),
    re.compile(r"isinstance\([^)]*\b(MedusaHeads|HydraHeads|HydraSpec|HeadsSpec)\b"),
    re.compile(r"head_type\s*=\s*['\"](medusa|hydra)['\"]\s*[,)]"),
]


def registered_dispatch() -> list[re.Pattern[str]]:
    """:data:`DISPATCH` for every registered type: a comparison with its name (``== "eagle3"``, ``in ("medusa",
    "hydra")``, ``case "hydra":``), a lookup of a built-in by name (``drafter_type("eagle3")``), or a test of its spec,
    module or tree drafter class (``isinstance``, ``issubclass``, ``type(x) is``)."""
    names = "|".join(re.escape(name) for name in head_types())
    classes = "|".join(sorted({c.__name__ for e in drafter_types() for c in (e.spec_cls, e.module_cls, e.tree_drafter)
                               if c is not None}))
    return DISPATCH + [
        re.compile(rf"[!=]=\s*['\"]({names})['\"]"),
        re.compile(rf"['\"]({names})['\"]\s*[!=]="),
        re.compile(rf"\bin\s*[(\[{{][^)\]}}]*['\"]({names})['\"]"),
        re.compile(rf"\bcase\s+['\"]({names})['\"]"),
        re.compile(rf"head_type\s*=\s*['\"]({names})['\"]\s*[,)]"),
        re.compile(rf"drafter_type\(\s*['\"]({names})['\"]"),
        re.compile(rf"\b(isinstance|issubclass)\([^)]*\b({classes})\b"),
        re.compile(rf"\btype\([^)]*\)\s*(is|==|!=)\s*(not\s+)?({classes})\b"),
    ]


def source_files() -> list[Path]:
    return sorted(p for folder in ("medusa_train", "inference") for p in (ROOT / folder).rglob("*.py"))


def test_no_module_outside_the_catalog_and_the_drafter_folders_dispatches_on_a_drafter_type():
    patterns = registered_dispatch()
    found = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in OWN_MODULES or rel.startswith(OWN_FOLDER):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in patterns) and line.strip() not in ALLOWED:
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "drafter types named outside the catalog and their folders:\n" + "\n".join(found)


def test_the_dispatch_patterns_catch_what_they_are_for():
    caught = ['if spec.head_type == "hydra":', "isinstance(heads, HydraHeads)", 'load_heads(f, head_type="medusa")',
              'if "medusa" != cfg.head_type:', 'if cell["drafter"] != "eagle3":', "if name in ('medusa', 'eagle3'):",
              'case "hydra":', 'entry = drafter_type("eagle3")', "isinstance(drafter, Eagle3TreeDrafter)",
              "issubclass(cls, Eagle3Spec)", "type(heads) is not MedusaHeads", 'load_heads(f, head_type="eagle3")']
    fine = ["entry = drafter_type(spec.head_type)", 'head_type: str = "medusa",', 'run_dir / "hydra"',
            'method: ClassVar[str] = "eagle3"', 'DecoderEntry("medusa", TreeSettings, _build_medusa,',
            'if config.get("model_type") != VLLM_MODEL_TYPE:', "isinstance(drafter, DynamicTreeDrafter)",
            'if name == "medusa1":']
    patterns = registered_dispatch()
    assert [line for line in caught if not any(p.search(line) for p in patterns)] == []
    assert [line for line in fine if any(p.search(line) for p in patterns)] == []


def test_every_drafter_folder_is_a_catalog_entry_with_real_imports():
    """Each built-in type's parts live in its folder (``medusa_train/drafters/<name>/``) and its entry holds them as
    objects, not names to import later."""
    for entry in drafter_types():
        folder = f"medusa_train.drafters.{entry.name}."
        assert entry.module_cls.__module__.startswith(folder) and entry.tree_drafter.__module__.startswith(folder)
        assert callable(entry.logits) and isinstance(entry.tree_drafter, type)
        for part in (*entry.engine_writers.values(), entry.vllm_config, entry.llamacpp_gguf, entry.options,
                     *(d.settings for d in entry.engine_decoders)):
            assert part is None or (callable(part) and part.__module__.startswith(folder)), (entry.name, part)


def test_the_shared_schema_and_the_decoder_registry_hold_nothing_of_a_drafter_type():
    """A type's options and its engine decoders are its folder's: the shared heads schema has none of them as its
    own fields (they come from the catalog, :func:`medusa_train.config.schema.heads_schema`), and the registry declares no
    settings class of a type (they come from the catalog, :func:`inference.registry.sync_drafter_decoders`)."""
    import dataclasses

    from inference import registry
    from medusa_train.config.schema import HeadsConfig, heads_schema

    options = {name for entry in drafter_types() for name in entry.option_names}
    assert options and not options & {f.name for f in dataclasses.fields(HeadsConfig)}
    assert options <= {f.name for f in dataclasses.fields(heads_schema())}
    declared = {d.name: d.settings for entry in drafter_types() for d in entry.engine_decoders}
    assert {"vllm_medusa", "vllm_eagle3", "llamacpp_eagle3"} <= set(declared)
    assert all(registry.REGISTRY[name].settings is settings for name, settings in declared.items())
    assert not [c for c in vars(registry).values() if isinstance(c, type) and c in declared.values()]


def test_the_built_in_types_declare_themselves():
    assert head_types()[:2] == ("medusa", "hydra")
    medusa, hydra = drafter_type("medusa"), drafter_type("hydra")
    assert medusa.engine_problem("vllm") is None and medusa.joint and not medusa.reads_path
    assert "Medusa heads only" in hydra.engine_problem("vllm") and hydra.reads_path and hydra.option_names == ("combine",)
    with pytest.raises(ValueError, match=r"heads.head_type: head_type 'eagle' is not one this medusa-train knows"):
        drafter_type("eagle", "heads.head_type")


def test_only_a_heads_module_is_a_drafter_not_a_model_that_exposes_its_spec():
    from medusa_train.models.catalog import is_drafter
    from medusa_train.drafters.medusa.heads import MedusaHeads

    heads = MedusaHeads(HeadsSpec(2, 1, 8, 11))

    class Wrapper(nn.Module):  # a joint model exposes its heads' spec; its buffers are not the heads'
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.spec = heads, heads.spec

    assert is_drafter(heads) and not is_drafter(Wrapper()) and type_of(Wrapper()) is drafter_type("medusa")


# ---- every registered type, by the catalog (greedy = plain greedy: tests/inference/test_decoders.py) ----------------

def layer_options(head_type: str, num_layers: int) -> dict[str, list[int]]:
    """Explicit target layers for a type that reads some (``feature_layers`` among its options; the tiny models are
    too shallow for vLLM's default EAGLE-3 taps), else nothing."""
    return {"feature_layers": [0, num_layers // 2, num_layers]} if "feature_layers" in drafter_type(
        head_type).option_names else {}


def layer_overrides(head_type: str, num_layers: int) -> list[str]:
    """:func:`layer_options` as Hydra overrides of ``heads.*``."""
    return [f"heads.{k}=[{','.join(map(str, v))}]" for k, v in layer_options(head_type, num_layers).items()]


def random_drafter(head_type: str, base: nn.Module, seed: int = 0) -> nn.Module:
    """Random heads of ``head_type`` for ``base`` (every parameter N(0, 0.3^2)), fp32."""
    from medusa_train.models.speculative import new_heads_for
    from tests.medusa_train.test_export import randomized

    options = layer_options(head_type, base.config.num_hidden_layers)
    return randomized(new_heads_for(base, 3, head_type=head_type, **options), seed, torch.float32)


@pytest.mark.parametrize("head_type", head_types())
def test_every_type_round_trips_through_its_export_with_identical_logits(head_type, tmp_path):
    from medusa_train.export import load_heads, save_export
    from medusa_train.models.speculative import SpeculativeModel
    from tests.conftest import make_tiny_model

    base = make_tiny_model("llama")
    heads = random_drafter(head_type, base, seed=3)
    save_export(heads, tmp_path, "tiny-llama", vllm=False, base_model=base)  # engine layouts: their own tests
    loaded, config = load_heads(tmp_path, base_model=base, head_type=head_type)
    assert type(loaded) is type(heads) and loaded.spec == heads.spec and config.get("head_type", "medusa") == head_type
    hidden = {name: torch.randn(2, 5, base.config.hidden_size) for name in type_of(heads).feature_names(heads.spec)}
    path = torch.randint(0, base.config.vocab_size, (2, 5, 3)) if drafter_type(head_type).reads_path else None
    before, after = SpeculativeModel(base, heads), SpeculativeModel(base, loaded)
    torch.testing.assert_close(after.head_logits(hidden, path), before.head_logits(hidden, path), rtol=0, atol=0)


@pytest.mark.parametrize("head_type", head_types())
def test_every_type_resumes_a_crashed_run_to_the_same_heads(head_type, tmp_path):
    from safetensors.torch import load_file

    from medusa_train.training.recipe import build_recipe

    model_dir, data = write_tiny_inputs(tmp_path)
    overrides = [f"heads.head_type={head_type}", *layer_overrides(head_type, 2)]  # write_tiny_inputs: 2 layers
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "whole") + overrides)).run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "crashed") + overrides),
                     callbacks=[CrashAtStep(6)]).run()
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "crashed", resume="true") + overrides)).run()
    weights = drafter_type(head_type).weights_file or "medusa_lm_head.safetensors"
    assert_same_heads(load_file(str(tmp_path / "whole" / "export" / weights)),
                      load_file(str(tmp_path / "crashed" / "export" / weights)))


@pytest.mark.slow
@pytest.mark.parametrize("head_type", head_types())
def test_every_types_tuner_replay_gives_the_decoders_counts(head_type, tmp_path):
    """Heads trained on stories260K (the default run, 60 steps); the replay of the teacher-forced ranks the tuner
    records is the tree decoder's count of tokens and passes on the same prompts, where the heads accept more than
    one token a pass."""
    from inference.decoders.base import DecodeConfig
    from inference.decoders.tree import TreeDecoder
    from medusa_train.loading.export import load_export
    from medusa_train.training.recipe import build_recipe
    from inference.tuning.accuracy import measure_head_accuracy
    from inference.tuning.replay import replay_counts

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path / 'run'}", f"heads.head_type={head_type}",
                                          *layer_overrides(head_type, 4),  # stories260K: 5 layers, too few for
                                          # vLLM's default EAGLE-3 taps; layers 0, 2, 4 (the last layer's input)
                                          "trainer.max_steps=60", "export_vllm=false", "trainer.disable_tqdm=true"])
    summary = build_recipe(cfg).run()
    model, tokenizer, _ = load_export(summary["export_dir"], dtype="float32", head_type=head_type)
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    decoder = TreeDecoder(model, tree, topk=4)
    prompts = [tokenizer(t)["input_ids"] for t in ("Once upon a time, there was a little girl named Lily.",
                                                   "The cat was sad.", "Tom had a big red ball.")]
    tokens = passes = 0
    for ids in prompts:
        result = decoder.generate(ids, DecodeConfig(max_new_tokens=48))
        tokens, passes = tokens + sum(result.accepted_lengths), passes + result.forward_passes
    assert tokens / passes > 1.3
    recorded = measure_head_accuracy(model, prompts, max_new_tokens=48, topk=4, eos_token_id=None)
    predicted_tokens, predicted_passes = replay_counts(recorded["target_ranks"], tree)
    assert predicted_tokens == tokens
    assert abs(predicted_passes - passes) <= 1  # a floating-point tie between cached and teacher-forced logits at most
