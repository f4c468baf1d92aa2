"""The memory plan (medusa_train.planning): exact parameter counts on meta, per-stage bytes against hand counts, the
70B/8B configs on 8 x 80 GiB, the benchmark script's JSON, and medusa-train refusing a run before any weight loads."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from medusa_train.config.schema import HeadsConfig, heads_schema
from medusa_train.files.paths import assets_dir
from medusa_train.planning import GIB, PlanSettings, build_plan, find_fix, heads_sizes, load_target_config, target_sizes
from medusa_train.planning.presets import heads_preset
from medusa_train.planning.stages import CUDA_RESERVE_BYTES

CONFIGS = assets_dir() / "configs"
ROOT = Path(__file__).resolve().parents[2]


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


# Hand counts of the tiny Llama (H 64, I 128, 4 heads of 16, 2 KV heads, V 1000, untied):
EMBED = 1000 * 64
LAYER = (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v (2 KV heads x 16), o
         + 3 * 64 * 128  # gate, up, down
         + 2 * 64)  # two RMSNorms
BASE = EMBED + 2 * LAYER + 64 + EMBED  # embeddings, 2 layers, final norm, lm_head
# Medusa, K 2, one block: block_weight [2, 1, 64, 64], block_bias [2, 1, 64], lm_head_weight [2, 1000, 64]
MEDUSA = 2 * 64 * 64 + 2 * 64 + 2 * 1000 * 64
MEDUSA_SHARED = 2 * 64 * 64 + 2 * 64
# Hydra (concat), K 2: head k reads (k + 2) H; residual Linear((k+2)H, H) without bias, one block Linear with bias
HYDRA = (128 * 64 + 128 * 64 + 64) + (192 * 64 + 192 * 64 + 64) + 2 * 1000 * 64
# EAGLE-3, draft vocabulary 100: fc [64, 3 x 64]; q/k/v read 2H; o; three norms; MLP; final norm; lm_head [100, 64]
EAGLE3 = 192 * 64 + 128 * 64 + 2 * 128 * 32 + 64 * 64 + 3 * 64 + 3 * 64 * 128 + 64 + 100 * 64


def test_the_tiny_target_and_each_drafter_count_exactly_what_a_hand_count_gives():
    config = tiny_config()
    sizes = target_sizes(config)
    assert (sizes.params, sizes.largest_layer, sizes.embed, sizes.lm_head) == (BASE, LAYER, EMBED, EMBED) == (
        202_048, 36_992, 64_000, 64_000)
    assert (sizes.num_layers, sizes.num_kv_heads, sizes.head_dim, sizes.linear_widths) == (2, 2, 16, 1024)
    count = {name: heads_sizes(cfg, config, sizes).params for name, cfg in {
        "medusa": HeadsConfig(num_heads=2),
        "shared": HeadsConfig(num_heads=2, share_lm_head=True),
        "hydra": HeadsConfig(head_type="hydra", num_heads=2),
        "eagle3": heads_schema()(head_type="eagle3", num_heads=2, head_vocab_size=100, feature_layers=[0, 1, 2]),
    }.items()}
    assert count == {"medusa": MEDUSA, "shared": MEDUSA_SHARED, "hydra": HYDRA, "eagle3": EAGLE3}
    assert count == {"medusa": 136_320, "shared": 8_320, "hydra": 169_088, "eagle3": 64_000}


def test_training_bytes_under_ddp_and_zero2_match_the_hand_count():
    """Medusa K=2 on the tiny target, 4 GPUs, bf16 heads, base fp32, 2 x 32 tokens a micro batch, chunk 16."""
    config = tiny_config()
    kw = dict(gpus=4, gpu_bytes=80 * GIB, seq=32, batch=2, base_dtype="float32", precision="bf16",
              loss_chunk_size=16, hidden_cache=True)
    heads = HeadsConfig(num_heads=2)
    P, tokens = MEDUSA, 2 * 32
    common = (tokens * 1 * (2 * (64 + 64)) * 2  # activations: K=2 block maps of in 64 + out 64, bf16
              + 2 * 16 * 1000 * 4  # the loss's logits chunk and its gradient, fp32
              + (EMBED + EMBED) * 4  # the base's lm_head and embeddings, fp32
              + 1 * tokens * 64 * 4  # the batch's cached final hidden states, fp32
              + CUDA_RESERVE_BYTES)
    ddp = build_plan(config, heads, PlanSettings(zero_stage=0, **kw)).stage("training")
    zero2 = build_plan(config, heads, PlanSettings(zero_stage=2, **kw)).stage("training")
    # ddp: fp32 params 4 + grads 4 + Adam 8 + autocast's bf16 copies 2 bytes, all on every rank
    assert ddp.gpu_bytes == 18 * P + common == 2_453_760 + common
    # zero2: bf16 params 2 on every rank; bf16 grads 2, fp32 master 4 and Adam 8 sharded over 4; 2 buckets x P x 2
    assert zero2.gpu_bytes == 2 * P + (2 * P + 4 * P + 8 * P) // 4 + 2 * P * 2 + common == 1_295_040 + common
    assert {t.name: t.bytes for t in zero2.gpu}["heads Adam m+v"] == 8 * P // 4


@pytest.fixture(scope="module")
def llama70b():
    return load_target_config(CONFIGS / "llama-3.1-70b.json")


def test_70b_medusa1_and_eagle3_fit_8_gpus_of_80_gib_at_seq_4096_with_the_planned_settings(llama70b):
    sizes = target_sizes(llama70b)
    assert sizes.params == 70_553_706_496 and sizes.vocab_size == 128_256 and sizes.lm_head == 128_256 * 8192
    s = PlanSettings(gpus=8, gpu_bytes=80 * GIB, seq=4096, self_distill=True, tokens=100_000_000)
    medusa = heads_preset("medusa1")
    ddp = build_plan(llama70b, medusa, s)
    # ddp replicates 16 B + 2 B of autocast copies per head parameter: K=4 fp32 lm_head copies alone are 67 GiB
    assert [p[0].name for p in ddp.problems()] == ["training"]
    zero2 = build_plan(llama70b, medusa, PlanSettings(**{**s.__dict__, "zero_stage": 2}))
    assert zero2.fits and zero2.stage("training").gpu_bytes < 40 * GIB
    assert find_fix(llama70b, medusa, s).changes == ("trainer=deepspeed_zero2",)
    eagle = find_fix(llama70b, heads_preset("eagle3"), s)
    assert eagle is not None and eagle.plan.fits and eagle.plan.peak_gpu_bytes <= 0.9 * 80 * GIB
    vllm = zero2.stage("self_distill").choices
    assert vllm == {"tensor_parallel_size": 4, "engines_per_host": 2, "gpu_memory_utilization": 0.55}
    # a cache row of the 70B: H x 2 B (one feature) + 24 B of tokens; EAGLE-3 keeps 4 features
    assert zero2.stage("cache_build").choices["bytes_per_token"] == 8192 * 2 + 24
    assert eagle.plan.stage("cache_build").choices["bytes_per_token"] == 4 * 8192 * 2 + 24
    # the greedy targets are projected trainer.loss_chunk_size positions at a time (2,048), not B x T at once
    logits = {t.name: t.bytes for t in zero2.stage("cache_build").gpu}["base logits (argmax targets)"]
    assert logits == 2048 * 128_256 * 2
    whole = build_plan(llama70b, medusa, PlanSettings(**{**s.__dict__, "zero_stage": 2, "loss_chunk_size": 0}))
    assert {t.name: t.bytes for t in whole.stage("cache_build").gpu}["base logits (argmax targets)"] == \
        s.batch * 4096 * 128_256 * 2  # 0: the whole batch's logits


def test_70b_medusa2_with_zero3_and_lora_fits_8_gpus_of_80_gib_once_the_base_is_checkpointed(llama70b):
    s = PlanSettings(gpus=8, gpu_bytes=80 * GIB, seq=4096, zero_stage=3, recipe="joint", hidden_cache=False)
    heads = heads_preset("medusa1")
    plain = build_plan(llama70b, heads, s)
    # every linear map's input and output of 80 layers at 8 x 4096 tokens: 790 GiB
    acts = plain.stage("training").gpu
    assert [p[0].name for p in plain.problems()] == ["training"]
    checkpointed = build_plan(llama70b, heads, PlanSettings(**{**s.__dict__, "gradient_checkpointing": True}))
    terms = {t.name: t.bytes for t in checkpointed.stage("training").gpu}
    assert terms["base layer inputs (checkpointed)"] == 80 * 8 * 4096 * 8192 * 2  # L x tokens x H x 2 B
    assert "base activations (with grad)" in {t.name for t in acts}
    fix = find_fix(llama70b, heads, s)
    assert fix is not None and "+trainer.extra.gradient_checkpointing=true" in fix.changes and fix.plan.fits


def test_70b_on_one_80_gib_gpu_does_not_fit_and_the_stages_are_named(llama70b):
    s = PlanSettings(gpus=1, gpu_bytes=80 * GIB, seq=4096, self_distill=True, zero_stage=3)
    plan = build_plan(llama70b, heads_preset("medusa1"), s)
    assert not plan.fits
    failing = {p[0].name: p[2] for p in plan.problems()}
    assert set(failing) == {"self_distill", "cache_build", "training"}
    assert failing["cache_build"] > 70_553_706_496 * 2  # the whole bf16 base on the one GPU
    record = plan.as_dict()
    assert record["fits"] is False and record["stages"]["cache_build"]["fits"] is False


def test_the_script_prints_a_table_and_as_its_last_line_a_json_object(capsys):
    spec = importlib.util.spec_from_file_location("memory_plan", ROOT / "benchmarks" / "memory_plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--config", str(CONFIGS / "llama-3.1-8b.json"), "--heads", "medusa", "--gpus", "8", "--gpu-gib",
                 "80", "--seq", "4096", "--tokens", "1000000"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("training") for line in lines)
    record = json.loads(lines[-1])
    assert record["fits"] is True and isinstance(record["peak_gib_per_gpu"], float)
    assert set(record["stages"]) == {"self_distill", "cache_build", "training", "export"}
    assert record["stages"]["cache_build"]["disk_gib"] == round(1_000_000 * (4096 * 2 + 24) / GIB, 3)
    assert record["target_params"] == 8_030_261_248


def load_script():
    spec = importlib.util.spec_from_file_location("memory_plan", ROOT / "benchmarks" / "memory_plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def config_without(tmp_path: Path, *fields: str) -> Path:
    """The 70B's config.json without ``fields``."""
    config = json.loads((CONFIGS / "llama-3.1-70b.json").read_text())
    for field in fields:
        del config[field]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


GIVEN = ["--heads", "medusa", "--gpus", "8", "--gpu-gib", "80", "--seq", "4096"]


@pytest.mark.parametrize("config, flags, line", [
    ("sizes", [], "--config {config} has no hidden_size, intermediate_size: transformers would put LlamaConfig's "
                  "defaults there (hidden_size=4096, intermediate_size=11008) and plan another model; give the model's "
                  "own config.json, or add hidden_size, intermediate_size to it"),
    ("missing", [], "--config {config}: no such file or folder (give the target's config.json or a local model folder "
                    "holding one)"),
    ("meta-llama/Llama-3.1-70B", [], "--config meta-llama/Llama-3.1-70B: no such file or folder (give the target's "
                                     "config.json or a local model folder holding one)"),  # never read as a Hub id
    ("70b", ["--seq", "131073"], "--seq 131073 is beyond the target's context (max_position_embeddings=131072 in "
                                 "{config}): give --seq 131072 or less"),
    ("70b", ["--host-gib", "0"], "--host-gib must be > 0 (RAM of one host in GiB; leave the flag out not to check "
                                 "it), got 0.0"),
    ("70b", ["--gpu-gib", "nan"], "--gpu-gib must be a finite number (memory of one GPU in GiB, e.g. 80), got nan"),
    ("70b", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("70b", ["--gpus-per-host", "16"], "--gpus-per-host 16 is more than --gpus 8: give at most --gpus"),
    ("70b", ["--heads", "eagle3", "--head-vocab-size", "200000"],
     "--head-vocab-size 200000 is more than the target's vocabulary of 128256 tokens: set --head-vocab-size 128256 "
     "or below"),
])
def test_every_refusal_of_the_script_is_one_line_naming_the_flag_and_the_fix_with_exit_2(config, flags, line,
                                                                                        tmp_path, capsys):
    path = {"sizes": lambda: config_without(tmp_path, "hidden_size", "intermediate_size"),
            "missing": lambda: tmp_path / "nowhere" / "config.json",
            "70b": lambda: CONFIGS / "llama-3.1-70b.json"}.get(config, lambda: config)()
    with pytest.raises(SystemExit) as e:
        load_script().main(["--config", str(path), *GIVEN, *flags])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert captured.err == f"memory_plan.py: error: {line.format(config=path)}\n"


def test_a_config_without_its_sizes_is_refused_by_the_script_without_a_traceback(tmp_path):
    config = config_without(tmp_path, "num_hidden_layers")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_plan.py"), "--config", str(config),
                           *GIVEN], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"memory_plan.py: error: --config {config} has no num_hidden_layers: transformers "
                                  "would put LlamaConfig's defaults there (num_hidden_layers=32)")


def test_medusa_train_refuses_a_base_config_without_its_sizes_before_loading(tmp_path):
    from medusa_train.planning.run_check import check_run_memory
    from medusa_train.training.base_recipe import resolve_config
    from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

    folder = tmp_path / "llama70b"
    folder.mkdir()
    shutil.copy(config_without(tmp_path, "hidden_size", "intermediate_size"), folder / "config.json")
    model_dir, data = write_tiny_inputs(tmp_path / "inputs", conversations=10)
    cfg, _ = resolve_config(compose_train(tiny_overrides(model_dir, data, tmp_path / "run") + [
        f"model.name_or_path={folder}", "plan_device_gib=80"]))
    with pytest.raises(ValueError, match=rf"^the config.json of model.name_or_path={folder} has no hidden_size, "
                                         r"intermediate_size: transformers would put LlamaConfig's defaults there"):
        check_run_memory(cfg, world_size=1)


def test_medusa_train_refuses_a_run_over_its_device_budget_before_loading(tmp_path, monkeypatch):
    import medusa_train.training.base_recipe as base_recipe
    from medusa_train.cli.train import train
    from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

    def loaded(*args, **kwargs):
        raise AssertionError("the base model was loaded before the memory plan refused the run")

    monkeypatch.setattr(base_recipe, "load_base_model", loaded)
    model_dir, data = write_tiny_inputs(tmp_path / "inputs", conversations=10)
    out = tmp_path / "run"
    # 1 GiB of process reserve plus 4 MiB: the loss's 2 x 2048 x 512 x 4 B = 8 MiB chunk does not fit, 1024 rows do
    overrides = tiny_overrides(model_dir, data, out) + [f"plan_device_gib={1 + 4 / 1024}"]
    with pytest.raises(ValueError, match=r"stage training needs [\d,]+ bytes .* available .*set "
                                         r"trainer\.loss_chunk_size=(1024|512)") as caught:
        train(compose_train(overrides))
    assert "plan_device_gib" in str(caught.value) and not out.exists()


def test_a_70b_config_folder_is_refused_on_one_device_naming_more_gpus(tmp_path):
    from medusa_train.planning.run_check import check_run_memory
    from medusa_train.training.base_recipe import resolve_config
    from tests.medusa_train.test_training import compose_train, tiny_overrides, write_tiny_inputs

    folder = tmp_path / "llama70b"
    folder.mkdir()
    shutil.copy(CONFIGS / "llama-3.1-70b.json", folder / "config.json")  # no weights at all
    model_dir, data = write_tiny_inputs(tmp_path / "inputs", conversations=10)
    cfg, _ = resolve_config(compose_train(tiny_overrides(model_dir, data, tmp_path / "run") + [
        f"model.name_or_path={folder}", "model.dtype=bfloat16", "plan_device_gib=80", "max_length=4096",
        "trainer.per_device_train_batch_size=1", "heads.num_heads=4", "trainer.precision=bf16"]))
    with pytest.raises(ValueError, match=r"stage training needs .* per CPU rank, 85,899,345,920 bytes \(80\.00 GiB\) "
                                         r"available .*set WORLD_SIZE=\d+ trainer=deepspeed_zero3"):
        check_run_memory(cfg, world_size=1)
