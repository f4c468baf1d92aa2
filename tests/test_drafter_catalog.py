"""The drafter catalog: no module but a drafter's own names a drafter type, and a new type is one module, one YAML
preset and one catalog entry. The "repeat" drafter below is defined here only; it trains, exports, resumes, tunes and
decodes exactly greedy through the real entry points, with no other file of the project changed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from medusa_train.drafters.catalog import (
    DrafterType,
    TargetInputs,
    drafter_type,
    head_types,
    registered,
    type_of,
)
from medusa_train.drafters.medusa.heads import HeadsSpec, register_token_map
from medusa_train.paths import CONF_DIR, PACKAGE_DIR
from tests.medusa_train.test_training import CrashAtStep, assert_same_heads, compose_train, tiny_overrides
from tests.medusa_train.test_training import write_tiny_inputs

ROOT = PACKAGE_DIR.parent
# The modules that may name a drafter type: the catalog and each type's own module.
OWN_MODULES = {"medusa_train/drafters/catalog.py", "medusa_train/drafters/medusa/heads.py", "medusa_train/hydra_heads.py"}
# Dispatch on a type by name or class, anywhere else, is what the catalog replaces.
DISPATCH = [
    re.compile(r"head_type\s*[!=]=\s*['\"]"),
    re.compile(r"['\"](medusa|hydra)['\"]\s*[!=]=\s*[\w.]*head_type"),
    re.compile(r"isinstance\([^)]*\b(MedusaHeads|HydraHeads|HydraSpec|HeadsSpec)\b"),
    re.compile(r"head_type\s*=\s*['\"](medusa|hydra)['\"]\s*[,)]"),
]


def source_files() -> list[Path]:
    return sorted(p for folder in ("medusa_train", "inference") for p in (ROOT / folder).rglob("*.py"))


def test_no_module_outside_the_catalog_dispatches_on_a_drafter_type():
    found = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in OWN_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in DISPATCH):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "drafter types named outside the catalog:\n" + "\n".join(found)


def test_the_dispatch_patterns_catch_what_they_are_for():
    caught = ['if spec.head_type == "hydra":', "isinstance(heads, HydraHeads)", 'load_heads(f, head_type="medusa")',
              'if "medusa" != cfg.head_type:']
    fine = ["entry = drafter_type(spec.head_type)", 'head_type: str = "medusa",', 'run_dir / "hydra"']
    assert all(any(p.search(line) for p in DISPATCH) for line in caught)
    assert not any(p.search(line) for p in DISPATCH for line in fine)


def test_the_built_in_types_declare_themselves():
    assert head_types()[:2] == ("medusa", "hydra")
    medusa, hydra = drafter_type("medusa"), drafter_type("hydra")
    assert medusa.engine_problem("vllm") is None and medusa.joint and not medusa.reads_path
    assert "Medusa heads only" in hydra.engine_problem("vllm") and hydra.reads_path and hydra.options == ("combine",)
    with pytest.raises(ValueError, match=r"heads.head_type: head_type 'eagle' is not one this medusa-train knows"):
        drafter_type("eagle", "heads.head_type")


def test_only_a_heads_module_is_a_drafter_not_a_model_that_exposes_its_spec():
    from medusa_train.drafters.catalog import is_drafter
    from medusa_train.drafters.medusa.heads import MedusaHeads

    heads = MedusaHeads(HeadsSpec(2, 1, 8, 11))

    class Wrapper(nn.Module):  # a joint model exposes its heads' spec; its buffers are not the heads'
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.spec = heads, heads.spec

    assert is_drafter(heads) and not is_drafter(Wrapper()) and type_of(Wrapper()) is drafter_type("medusa")


# ---- a drafter type defined by this test only ------------------------------------------------------------------------

@dataclass(frozen=True)
class RepeatSpec(HeadsSpec):
    """Shape of the repeat drafter: HeadsSpec's fields only."""


class RepeatHeads(nn.Module):
    """Every head guesses the target's own next token again: ``hidden [..., H] @ proj [V', H]^T + bias[k]``, the
    projection copied from the target's lm_head. A drafter nobody would ship, and the smallest that trains."""

    def __init__(self, spec: RepeatSpec, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.proj = nn.Parameter(torch.zeros(spec.out_size, spec.hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_heads, spec.out_size))
        register_token_map(self, spec, token_map)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.dtype

    @torch.no_grad()
    def init_from_lm_head(self, weight: torch.Tensor) -> None:
        self.proj.copy_(weight if self.token_map is None else weight[self.token_map])

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        k = num_heads or self.spec.num_heads
        logits = hidden.to(self.dtype) @ self.proj.T  # [..., V']
        return logits[None] + self.bias[:k].reshape(k, *([1] * (logits.dim() - 1)), -1)  # [K', ..., V']

    def to_base_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]


def repeat_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None) -> torch.Tensor:
    return heads(inputs.features["final"], num_heads)


REPEAT = DrafterType(
    name="repeat", title="Repeat", spec_cls=RepeatSpec, module_cls=RepeatHeads, logits=repeat_logits,
    source="this test", weights_file="repeat_heads.safetensors",
    config_keys={"num_heads": "repeat_num_heads", "num_layers": "repeat_num_layers"},
    tree_drafter="inference.proposers.tree_drafters:MedusaTreeDrafter",  # heads computed at once, read per tree level
)
PRESET = "defaults:\n  - /schema/heads/base@_here_\n  - _self_\nhead_type: repeat\nmedusa_num_heads: 2\n"


@pytest.fixture
def repeat_type(tmp_path):
    """The type registered and its YAML preset (``heads=repeat``) on Hydra's search path, for one test."""
    conf = tmp_path / "conf"
    (conf / "heads").mkdir(parents=True)
    (conf / "heads" / "repeat.yaml").write_text(PRESET)
    with registered(REPEAT):
        yield f"hydra.searchpath=[file://{conf}]"


def test_a_new_drafter_type_trains_exports_resumes_tunes_and_decodes_exactly_greedy(repeat_type, tmp_path):
    from inference.decoders.base import DecodeConfig
    from inference.decoders.medusa import MedusaDecoder
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
    decoder = MedusaDecoder.from_pretrained(str(export), dtype="float32")
    assert type(decoder.model.heads) is RepeatHeads and decoder.model.head_type == "repeat"
    vanilla = VanillaDecoder(decoder.model.base)
    request = DecodeConfig(max_new_tokens=24)
    for prompt in ([1, 5, 9, 13], [7, 7, 7, 7, 7, 7], [300, 2, 44]):
        assert decoder.generate(prompt, request).tokens == vanilla.generate(prompt, request).tokens


def test_a_registered_type_is_refused_where_it_cannot_go(repeat_type, tmp_path):
    model_dir, data = write_tiny_inputs(tmp_path)
    cfg = compose_train(tiny_overrides(model_dir, data, tmp_path / "run") + [repeat_type, "heads=repeat",
                                                                               "heads.mode=medusa2"])
    from medusa_train.config import TrainConfig, as_dataclass

    with pytest.raises(ValueError, match=r"heads.head_type=repeat trains the heads on a frozen base.*for Medusa heads"):
        as_dataclass(TrainConfig, cfg)
    with pytest.raises(ValueError, match=r"heads.combine=sum is for Hydra heads, not Repeat heads"):
        as_dataclass(TrainConfig, compose_train(tiny_overrides(model_dir, data, tmp_path / "run")
                                      + [repeat_type, "heads=repeat", "heads.combine=sum"]))


# ---- every registered type, by the catalog (greedy = plain greedy: tests/inference/test_decoders.py) ----------------

def layer_options(head_type: str, num_layers: int) -> dict[str, list[int]]:
    """Explicit target layers for a type that reads some (``feature_layers`` among its options; the tiny models are
    too shallow for vLLM's default EAGLE-3 taps), else nothing."""
    return {"feature_layers": [0, num_layers // 2, num_layers]} if "feature_layers" in drafter_type(
        head_type).options else {}


def layer_overrides(head_type: str, num_layers: int) -> list[str]:
    """:func:`layer_options` as Hydra overrides of ``heads.*``."""
    return [f"heads.{k}=[{','.join(map(str, v))}]" for k, v in layer_options(head_type, num_layers).items()]


def random_drafter(head_type: str, base: nn.Module, seed: int = 0) -> nn.Module:
    """Random heads of ``head_type`` for ``base`` (every parameter N(0, 0.3^2)), fp32."""
    from medusa_train.model import new_heads_for
    from tests.medusa_train.test_export import randomized

    options = layer_options(head_type, base.config.num_hidden_layers)
    return randomized(new_heads_for(base, 3, head_type=head_type, **options), seed, torch.float32)


@pytest.mark.parametrize("head_type", head_types())
def test_every_type_round_trips_through_its_export_with_identical_logits(head_type, tmp_path):
    from medusa_train.export import load_heads, save_export
    from medusa_train.model import MedusaModel
    from tests.conftest import make_tiny_model

    base = make_tiny_model("llama")
    heads = random_drafter(head_type, base, seed=3)
    save_export(heads, tmp_path, "tiny-llama", vllm=False, base_model=base)  # engine layouts: their own tests
    loaded, config = load_heads(tmp_path, base_model=base, head_type=head_type)
    assert type(loaded) is type(heads) and loaded.spec == heads.spec and config.get("head_type", "medusa") == head_type
    hidden = {name: torch.randn(2, 5, base.config.hidden_size) for name in type_of(heads).feature_names(heads.spec)}
    path = torch.randint(0, base.config.vocab_size, (2, 5, 3)) if drafter_type(head_type).reads_path else None
    before, after = MedusaModel(base, heads), MedusaModel(base, loaded)
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
    from inference.decoders.medusa import MedusaDecoder
    from medusa_train.loading.medusa import load_medusa
    from medusa_train.training.recipe import build_recipe
    from inference.tuning.accuracy import measure_head_accuracy
    from inference.tuning.replay import replay_counts

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path / 'run'}", f"heads.head_type={head_type}",
                                          *layer_overrides(head_type, 4),  # stories260K: 5 layers, too few for
                                          # vLLM's default EAGLE-3 taps; layers 0, 2, 4 (the last layer's input)
                                          "trainer.max_steps=60", "export_vllm=false", "trainer.disable_tqdm=true"])
    summary = build_recipe(cfg).run()
    model, tokenizer, _ = load_medusa(summary["export_dir"], dtype="float32", head_type=head_type)
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    decoder = MedusaDecoder(model, tree, topk=4)
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
