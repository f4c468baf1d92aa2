"""EAGLE-3 drafters trained by our pipeline: the training-time test against the inference chain it stands for, the
recipe (loss, accuracy, hidden cache, resume, token map) and the settings refused before any training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from medusa_train.models.catalog import drafter_type, shifted_path_tokens
from medusa_train.models.features import layer_feature
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from medusa_train.training import base_recipe
from medusa_train.training.recipe import build_recipe
from tests.conftest import make_tiny_model
from tests.medusa_train.test_export import randomized
from tests.medusa_train.test_training import (
    CrashAtStep,
    assert_same_heads,
    compose_train,
    tiny_overrides,
    write_tiny_inputs,
)

K = 3
WEIGHTS = drafter_type("eagle3").weights_file
# heads=eagle3 on write_tiny_inputs' 2-layer Llama (vocab 512): explicit layers, a draft vocabulary of 256 tokens.
EAGLE3 = ["heads=eagle3", "heads.feature_layers=[0,1,2]", "heads.head_vocab_size=256"]


@pytest.fixture(scope="module")
def eagle3_model() -> SpeculativeModel:
    """An 8-layer tiny Llama (vLLM's default taps 2, 4, 5) with a random fp32 drafter of K steps."""
    base = make_tiny_model("llama", num_hidden_layers=8)
    return SpeculativeModel(base, randomized(new_heads_for(base, K, head_type="eagle3"), 5, torch.float32))


def inference_chain(model: SpeculativeModel, ids: torch.Tensor, t: int) -> list[torch.Tensor]:
    """Draft steps 0.. from position t of one sequence ``ids [T]`` as decoding runs them when every draft is right:
    the drafter over the context 0..t with its own KV cache (fused target features, embeddings of tokens s+1), then
    one step at a time at positions t+1, t+2, ..., reading its own ``out`` and the true next token's embedding.
    Returns the logits ``[V']`` of each step whose token lies inside ``ids``."""
    heads = model.heads
    features, _ = model.features(ids[None, : t + 2])
    taps = [features[layer_feature(i)][:, : t + 1] for i in heads.spec.feature_layers]
    cache = DynamicCache()
    causal = torch.full((t + 1, t + 1), torch.finfo(torch.float32).min).triu(1)[None, None]
    logits, out = heads(heads.fuse(taps), model.embed(ids[None, 1 : t + 2]), torch.arange(t + 1)[None], causal, cache)
    chain, hidden = [logits[0, -1]], out[:, -1:]
    for k in range(1, K):
        if t + k + 1 >= len(ids):
            break
        logits, hidden = heads(hidden, model.embed(ids[None, t + k + 1 : t + k + 2]), torch.tensor([[t + k]]),
                               None, cache)
        chain.append(logits[0, -1])
    return chain


def test_the_training_time_test_is_the_inference_chain_with_the_true_tokens(eagle3_model):
    model = eagle3_model
    assert model.heads.spec.feature_layers == (2, 4, 5)  # vLLM's (2, L // 2, L - 3) for L = 8
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ttt = model(ids).head_logits  # [K, B, T, V']
        assert ttt.shape == (K, 2, 11, model.heads.spec.out_size)
        compared = 0
        for b in range(2):
            for t in range(10):
                for k, logits in enumerate(inference_chain(model, ids[b], t)):
                    torch.testing.assert_close(ttt[k, b, t], logits, atol=1e-5, rtol=0, msg=f"step {k} at {t}")
                    compared += 1
    assert compared == 2 * (10 + 9 + 8)
    # the steps are not interchangeable: step 1 differs from what step 0 gives one position later
    assert (ttt[1, :, :8] - ttt[0, :, 1:9]).abs().max() > 1e-2


def test_padding_changes_no_real_positions_logits(eagle3_model):
    model = eagle3_model
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # row 1: 6 real tokens, then padding holding other tokens
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).head_logits
        alone = model(ids[1:, :6]).head_logits
    for k in range(K):  # step k at t reads the tokens up to t + k + 1: real ones for t < 5 - k
        torch.testing.assert_close(padded[k, 1, : 5 - k], alone[k, 0, : 5 - k], atol=1e-5, rtol=0)
    assert torch.isfinite(padded).all()
    assert (padded[0, 1, 5] - alone[0, 0, 5]).abs().max() > 1e-3  # token 6: a padding token, not the end


def unroll_inputs(heads, B: int, T: int, seed: int) -> dict:
    """Random fp32 taps ``[B, T, H]`` (requiring grad) and path embeddings ``[B, T, K, H]`` for ``heads.unroll``."""
    g = torch.Generator().manual_seed(seed)
    H = heads.spec.hidden_size
    taps = [torch.randn(B, T, H, generator=g).requires_grad_() for _ in heads.spec.feature_layers]
    return dict(taps=taps, path_embeds=torch.randn(B, T, K, H, generator=g))


def test_the_compact_unroll_at_the_loss_positions_is_the_full_unroll_there(eagle3_model):
    """With ``at``, the later steps run at the loss positions only: the same logits, lm_head inputs and gradients
    (weights and taps) as the full unroll read at those positions, with padding, sequences of different loss counts
    (one with none), unsorted and repeated positions."""
    heads = eagle3_model.heads
    B, T = 3, 12
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 7:] = 0
    b = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1])  # sequence 2: no loss position
    t = torch.tensor([11, 4, 5, 6, 2, 3, 9, 4, 8])  # unsorted, (0, 4) twice, (1, 8) a padding position
    weights = torch.randn(K, len(b), heads.spec.out_size, generator=torch.Generator().manual_seed(3))
    results = []
    for at in (None, (b, t)):
        inputs = unroll_inputs(heads, B, T, seed=2)
        heads.zero_grad()
        seen = []

        def project_fn(features, lm_head_weight):
            seen.append(features.detach())
            return features @ lm_head_weight.T

        logits = heads.unroll(**inputs, attention_mask=mask, at=at, project_fn=project_fn)
        if at is None:
            logits, seen[0] = logits[:, b, t], seen[0][:, b, t]
        (logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in heads.named_parameters()} | {
            f"tap{i}": x.grad for i, x in enumerate(inputs["taps"])}
        results.append((logits.detach(), seen[0], grads))
    (full, full_features, full_grads), (compact, compact_features, compact_grads) = results
    assert compact.shape == (K, len(b), heads.spec.out_size)
    torch.testing.assert_close(compact, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(compact_features, full_features, atol=1e-5, rtol=0)
    assert full_grads.keys() == compact_grads.keys() and len(full_grads) > 10
    for name, grad in full_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(compact_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_loss_slots_lay_each_sequences_positions_out_in_order():
    from medusa_train.drafters.eagle3.drafter import loss_slots

    queries, (b, j) = loss_slots((torch.tensor([1, 0, 1, 0]), torch.tensor([5, 3, 2, 3])), batch=3, length=6)
    assert queries.tolist() == [[3, 5], [2, 5], [5, 5]]  # padding slots repeat T - 1
    assert b.tolist() == [1, 0, 1, 0] and j.tolist() == [1, 0, 0, 0]


def test_rope_is_transformers_llama_rotary_embedding(eagle3_model):
    heads = eagle3_model.heads
    x, positions = torch.zeros(1, 7, 2 * heads.spec.hidden_size), torch.arange(3, 10)[None]
    expected = LlamaRotaryEmbedding(heads.spec.layer_config())(x, positions)
    for got, want in zip(heads.rope(x, positions), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not any(name.startswith("rot") for name in heads.state_dict())


def test_sequence_types_need_their_named_features(eagle3_model):
    with pytest.raises(ValueError, match=r"EAGLE-3 heads read the target features \['layer2', 'layer4', 'layer5'\]"):
        eagle3_model.head_logits(torch.zeros(1, 4, eagle3_model.heads.spec.hidden_size),
                                 shifted_path_tokens(torch.ones(1, 4, dtype=torch.long), K))


# ---- the recipe ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> tuple[Path, Path]:
    return write_tiny_inputs(tmp_path_factory.mktemp("tiny"))


def test_eagle3_training_lowers_the_loss_and_raises_head_0_accuracy(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "run", **{
        "trainer.max_steps": 16, "trainer.save_steps": 16}) + EAGLE3))
    try:
        recipe.setup()
        heads = recipe.trainer.model
        assert heads.spec.num_heads == 2 and heads.token_map.numel() == 256  # from the training replies' tokens
        torch.testing.assert_close(heads.lm_head.weight, recipe.base.get_output_embeddings().weight[heads.token_map])
        before = recipe.accuracy_table(heads, recipe.frozen_base)
        recipe.train()
        recipe.save()
    finally:
        recipe.cleanup()
    after = recipe.summary["accuracy"]
    losses = [e["loss"] for e in recipe.trainer.state.log_history if "loss" in e]
    assert losses[-1] < 0.8 * losses[0]
    assert after["top1"][0] > before["top1"][0] + 0.1
    assert after["loss"][0] < before["loss"][0]
    assert (tmp_path / "run" / "export" / WEIGHTS).is_file()


def test_cached_and_uncached_training_give_the_same_drafter(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    for name, cache in (("plain", "false"), ("cached", "true")):
        build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / name, hidden_cache=cache) + EAGLE3)).run()
    shards = load_file(str(next((tmp_path / "cached" / "hidden_cache").glob("train-*.safetensors"))))
    assert {"hidden", "layer0", "layer1", "layer2"} <= {k.split(".")[0] for k in shards}  # three taps and FINAL
    assert_same_heads(load_file(str(tmp_path / "plain" / "export" / WEIGHTS)),
                      load_file(str(tmp_path / "cached" / "export" / WEIGHTS)))


def test_a_crashed_cached_run_resumes_to_the_same_drafter(tiny_inputs, tmp_path):
    model_dir, data = tiny_inputs
    overrides = [*EAGLE3, "hidden_cache=true"]
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "whole") + overrides)).run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "crashed") + overrides),
                     callbacks=[CrashAtStep(6)]).run()
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "crashed", resume="true") + overrides)).run()
    whole = load_file(str(tmp_path / "whole" / "export" / WEIGHTS))
    assert "fc.weight" in whole and not any(k.startswith("rot") for k in whole)
    assert_same_heads(whole, load_file(str(tmp_path / "crashed" / "export" / WEIGHTS)))


@pytest.fixture
def cpu_flags(monkeypatch):
    """Fake the CPU's instruction-set flags (:data:`medusa_train.config.precision.CPU_FLAGS_ENV`): ``cpu_flags(flags)``."""
    from medusa_train.config.precision import CPU_FLAGS_ENV

    return lambda flags: monkeypatch.setenv(CPU_FLAGS_ENV, " ".join(sorted(flags)))


def export_training_record(run: Path) -> dict:
    import json

    return json.loads((run / "export" / "config.json").read_text())["training"]


@pytest.mark.slow
def test_auto_precision_trains_in_bf16_on_an_amx_cpu_with_the_hidden_cache(tiny_inputs, tmp_path, cpu_flags):
    """trainer.precision=auto on a (faked) AMX CPU: the HF Trainer's bf16 autocast on the CPU, end to end through
    the hidden cache and the training-time test; the export records what was asked for, used and why."""
    from tests.conftest import SAPPHIRE_RAPIDS

    cpu_flags(SAPPHIRE_RAPIDS)
    model_dir, data = tiny_inputs
    run = tmp_path / "run"
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, data, run, hidden_cache="true", **{
        "trainer.precision": "auto", "model.dtype": "float32"}) + EAGLE3))
    assert recipe.resolved["trainer"]["precision"] == "auto" and recipe.cfg.trainer.precision == "bf16"
    recipe.run()
    assert recipe.trainer.args.bf16 and not recipe.trainer.args.fp16
    losses = [e["loss"] for e in recipe.trainer.state.log_history if "loss" in e]
    assert len(losses) >= 3 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    record = export_training_record(run)["precision"]
    assert record["precision"] == "bf16" and record["requested"] == "auto" and record["device"] == "cpu"
    assert "amx_bf16" in record["reason"] and "amx_bf16" in record["cpu"]["flags"]
    weights = load_file(str(run / "export" / WEIGHTS))
    assert weights["fc.weight"].dtype == torch.float32  # fp32 master weights, bf16 only inside the autocast


def test_auto_precision_is_fp32_on_an_avx2_cpu(tiny_inputs, tmp_path, cpu_flags):
    from tests.conftest import AVX2_ONLY

    cpu_flags(AVX2_ONLY)
    recipe = build_recipe(compose_train(tiny_overrides(*tiny_inputs, tmp_path / "run", **{
        "trainer.precision": "auto"}) + EAGLE3))
    assert recipe.cfg.trainer.precision == "fp32" and recipe.resolved["trainer"]["precision"] == "auto"
    assert "no bf16 instructions" in recipe.precision.reason
    assert recipe.training_record()["precision"]["precision"] == "fp32"


@pytest.mark.slow
def test_more_steps_and_a_large_draft_vocabulary_reach_training_and_export(tiny_inputs, tmp_path):
    """heads.num_heads (K, the unrolled steps) and heads.head_vocab_size=8192 through the hidden cache to
    the exported drafter (a tiny target with a 16,384-token vocabulary, the tiny tokenizer's 512 ids among it)."""
    import json

    from transformers import AutoTokenizer

    model_dir = tmp_path / "wide_vocab"
    make_tiny_model("llama", vocab_size=16384).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_inputs[0]).save_pretrained(model_dir)
    run = tmp_path / "run"
    recipe = build_recipe(compose_train(tiny_overrides(model_dir, tiny_inputs[1], run, hidden_cache="true", **{
        "heads.num_heads": 3, "trainer.max_steps": 4}) + [*EAGLE3[:2], "heads.head_vocab_size=8192"]))
    recipe.run()
    heads = recipe.trainer.model
    assert heads.spec.num_heads == 3 and heads.spec.out_size == 8192
    weights = load_file(str(run / "export" / WEIGHTS))
    H = heads.spec.hidden_size
    assert weights["lm_head.weight"].shape == (8192, H)
    token_map = load_file(str(run / "export" / "token_map.safetensors"))["token_map"]
    assert token_map.shape == (8192,) and token_map.max() < 16384
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["eagle3_num_steps"] == 3 and config["head_vocab_size"] == 8192


# ---- refused before training -----------------------------------------------------------------------------------------

@pytest.fixture
def no_data_preparation(monkeypatch):
    """Fail loudly if a run gets as far as preparing its data."""
    def refuse(*args, **kwargs):
        raise AssertionError("the data was prepared before the setting was refused")

    monkeypatch.setattr(base_recipe, "prepare_data", refuse)


def four_layer_inputs(folder: Path, tiny_inputs: tuple[Path, Path]) -> Path:
    """write_tiny_inputs' model with 4 layers (too few for vLLM's default taps), same tokenizer."""
    from transformers import AutoTokenizer

    model_dir = folder / "four_layers"
    make_tiny_model("llama", vocab_size=512, num_hidden_layers=4).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_inputs[0]).save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("overrides,message", [
    (["heads=eagle3", "heads.head_vocab_size=256"], r"heads.feature_layers=null \(vLLM's default taps\).*L = 4"),
    (["heads=eagle3", "heads.head_vocab_size=256", "heads.feature_layers=[0,2,5]"],
     r"heads.feature_layers: layer 5 is out of range for a target with 4 layers"),
    ([EAGLE3[0], EAGLE3[2], "heads.feature_layers=[1,3]"], r"heads.feature_layers=\[1, 3\]: EAGLE-3 fuses three"),
    ([*EAGLE3, "heads.share_lm_head=true"], r"heads.share_lm_head=true: an EAGLE-3 drafter projects with its own"),
    (["heads=eagle3", "heads.feature_layers=[0,1,2]"],  # the preset's draft vocabulary, 4,096, on a 512-token target
     r"^heads.head_vocab_size=4096 is more than the target's vocabulary of 512 tokens: set heads.head_vocab_size=512 "
     r"or below$"),
])
def test_bad_eagle3_settings_are_refused_once_the_target_loads_before_its_data(
        overrides, message, tiny_inputs, tmp_path, no_data_preparation):
    model_dir = four_layer_inputs(tmp_path, tiny_inputs)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        build_recipe(compose_train(tiny_overrides(model_dir, tiny_inputs[1], run) + overrides)).run()
    assert not (run / "train_config.yaml").exists()


@pytest.mark.parametrize("overrides,message", [
    (["heads=eagle3", "heads.mode=joint"], r"heads.head_type=eagle3 trains the heads on a frozen base"),
    (["heads.feature_layers=[0,1,2]"], r"heads.feature_layers=\[0, 1, 2\] is for EAGLE-3 heads, not Medusa heads: "
                                       r"set heads=eagle3"),
    (["heads=hydra", "heads.feature_layers=[0,1,2]"], r"heads.feature_layers=\[0, 1, 2\] is for EAGLE-3 heads, not "
                                                      r"Hydra heads"),
])
def test_eagle3_settings_for_other_flows_are_refused_before_any_model_loads(overrides, message, tiny_inputs, tmp_path):
    from medusa_train.config.schema import TrainConfig, as_dataclass

    with pytest.raises(ValueError, match=message):
        as_dataclass(TrainConfig, compose_train(tiny_overrides(*tiny_inputs, tmp_path / "run") + overrides))


# ---- two ranks -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("trainer,cache", [("ddp", "true"), ("deepspeed_zero3", "false")])
def test_two_ranks_train_the_same_drafter_as_one_process(trainer, cache, tiny_inputs, tmp_path):
    """The training-time test runs through the wrapper's forward: DDP averages, ZeRO-3 gathers every weight."""
    from tests.medusa_train.test_distributed import RANK_BATCH, check_ok, launch

    model_dir, data = tiny_inputs
    build_recipe(compose_train(tiny_overrides(model_dir, data, tmp_path / "single", hidden_cache=cache) + EAGLE3)).run()
    out = tmp_path / trainer
    check_ok(launch([f"trainer={trainer}", *tiny_overrides(model_dir, data, out, hidden_cache=cache, **RANK_BATCH),
                     *EAGLE3]))
    assert_same_heads(load_file(str(tmp_path / "single" / "export" / WEIGHTS)),
                      load_file(str(out / "export" / WEIGHTS)))
