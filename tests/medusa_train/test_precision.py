"""dtype=auto and the checks of an explicit dtype: one decision, by the CPU's flags (faked here) or the GPU."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas as register_evaluate_schemas
from inference.cli.tune_tree import register_schemas as register_tune_tree_schemas
from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from medusa_train.config.precision import BF16_WITHOUT_INSTRUCTIONS, choose_dtype, cpu_isa
import medusa_train.config.precision as precision
from tests.conftest import AVX2_ONLY, SAPPHIRE_RAPIDS, ZEN4, make_tiny_model, make_tiny_tokenizer

register_evaluate_schemas()  # what conf/evaluate.yaml composes from
register_tune_tree_schemas()  # and conf/tune_tree.yaml



@pytest.fixture
def cpu(monkeypatch):
    """Fake the CPU's flags: ``cpu(flags)``."""
    def fake(flags: frozenset[str]) -> None:
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    return fake


@pytest.mark.parametrize("flags, dtype, found", [(AVX2_ONLY, torch.float32, "no bf16 instructions"),
                                                  (ZEN4, torch.bfloat16, "avx512_bf16"),
                                                  (SAPPHIRE_RAPIDS, torch.bfloat16, "avx512_bf16, amx_bf16")])
def test_auto_on_a_cpu_follows_its_bf16_instructions(cpu, flags, dtype, found):
    cpu(flags)
    choice = choose_dtype("auto", "cpu")
    assert choice.dtype == dtype and found in choice.reason and choice.warning is None
    assert choice.record()["cpu"]["flags"] == [f for f in precision.ISA_FLAGS if f in flags]
    assert choice.record()["cpu"]["bf16_instructions"] == (dtype == torch.bfloat16)
    assert choose_dtype(None, torch.device("cpu")).dtype == dtype  # None means auto


@pytest.mark.parametrize("bf16_gpu, dtype", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_on_cuda_takes_bf16_where_the_gpu_has_it(cpu, monkeypatch, bf16_gpu, dtype):
    cpu(AVX2_ONLY)  # the host CPU does not matter on a GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_gpu)
    choice = choose_dtype("auto", "cuda:1")
    assert choice.dtype == dtype and choice.device == "cuda"


@pytest.mark.parametrize("flags, expected, found", [(AVX2_ONLY, "fp32", "no bf16 instructions"),
                                                     (SAPPHIRE_RAPIDS, "bf16", "amx_bf16")])
def test_training_precision_auto_on_a_cpu_follows_its_bf16_instructions(cpu, flags, expected, found):
    cpu(flags)
    choice = precision.choose_precision("auto", "cpu")
    assert choice.precision == expected and choice.requested == "auto" and found in choice.reason
    assert choice.record()["cpu"]["bf16_instructions"] == (expected == "bf16")
    assert precision.choose_precision("fp32", "cpu").precision == "fp32"  # an explicit one passes through
    assert precision.choose_precision("bf16", "cpu").reason == "requested"


@pytest.mark.parametrize("bf16_gpu, expected", [(True, "bf16"), (False, "fp32")])
def test_training_precision_auto_on_cuda_is_bf16_or_fp32_never_fp16(cpu, monkeypatch, bf16_gpu, expected):
    cpu(AVX2_ONLY)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_gpu)
    choice = precision.choose_precision("auto", "cuda:0")
    assert choice.precision == expected and choice.device == "cuda"
    assert bf16_gpu or "set trainer.precision=fp16" in choice.reason


def test_bf16_forced_on_a_cpu_without_bf16_instructions_works_but_warns_with_the_slowdown(cpu):
    cpu(AVX2_ONLY)
    with pytest.warns(RuntimeWarning, match="about 3x slower than float32"):
        choice = choose_dtype("bf16", "cpu")
    assert choice.dtype == torch.bfloat16 and choice.warning == BF16_WITHOUT_INSTRUCTIONS
    cpu(ZEN4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_dtype("bfloat16", "cpu").warning is None


def test_float16_on_a_cpu_is_refused_with_the_reason(cpu):
    cpu(SAPPHIRE_RAPIDS)
    with pytest.raises(ValueError, match=r"dtype=float16 on the CPU: PyTorch has no fast float16 .* use dtype=auto"):
        choose_dtype("float16", "cpu")
    assert choose_dtype("float32", "cpu").reason == "requested"


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("float8", "cpu")
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        ModelConfig(name_or_path="x", dtype="half").validate()
    ModelConfig(name_or_path="x", dtype="auto").validate()


def test_this_machines_flags_come_from_proc_cpuinfo_or_torch(monkeypatch):
    monkeypatch.delenv(precision.CPU_FLAGS_ENV, raising=False)  # the machine's own, whatever --cpu the suite runs as
    isa = cpu_isa()
    caps = torch.cpu.get_capabilities()
    if caps.get("architecture") == "x86_64" or isa["machine"] == "x86_64":
        # the kernel's view and cpuinfo's CPUID query agree on the bf16 instructions
        assert isa["bf16_instructions"] == bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


@pytest.mark.parametrize("value, dtype", [("avx2 fma", torch.float32), ("AVX2,avx512f,avx512_bf16", torch.bfloat16),
                                          ("avx2, amx_tile, amx_bf16", torch.bfloat16), ("", torch.float32)])
def test_medusa_cpu_flags_replaces_the_machines_flags_for_auto(monkeypatch, value, dtype):
    monkeypatch.setenv(precision.CPU_FLAGS_ENV, value)
    assert precision.cpu_flags() == frozenset(value.replace(",", " ").lower().split())
    choice = choose_dtype("auto", "cpu")
    assert choice.dtype == dtype and choice.cpu["bf16_instructions"] == (dtype == torch.bfloat16)


def test_the_suites_cpu_option_reaches_subprocesses(pytestconfig):
    """``pytest --cpu=KIND`` sets MEDUSA_CPU_FLAGS, so a command a test runs resolves auto as that CPU too."""
    import subprocess
    import sys

    code = "from medusa_train.config.precision import choose_dtype; print(choose_dtype('auto', 'cpu').name)"
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert seen == choose_dtype("auto", "cpu").name
    kind = pytestconfig.getoption("--cpu")
    if kind != "native":
        assert seen == ("float32" if kind == "avx2" else "bfloat16")


@pytest.fixture
def export(tmp_path):
    base = make_tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    make_tiny_tokenizer().save_pretrained(tmp_path / "base")
    save_export(new_heads_for(base, num_heads=2), tmp_path / "export", str(tmp_path / "base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(tmp_path / "base"))))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["hello there"]}) + "\n")
    return tmp_path / "export", prompts


def _eval_config(export, prompts, out, *extra):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=[f"export_dir={export}", f"prompts={prompts}", f"output_dir={out}",
                                              "decoders=[vanilla,medusa]", "max_new_tokens=6", "progress=false",
                                              "warmup=0", "plots=false", "threads=1", *extra])


def test_eval_and_tune_tree_default_to_auto_and_record_the_choice(export, tmp_path, cpu, capsys):
    from inference.evaluation.eval_run import evaluate
    from inference.cli.tune_tree import run as tune

    folder, prompts = export
    cpu(AVX2_ONLY)  # auto -> float32 whatever this machine has
    summary = evaluate(_eval_config(folder, prompts, tmp_path / "run"))
    assert summary["dtype"] == "float32"
    assert summary["precision"]["requested"] == "auto" and "no bf16 instructions" in summary["precision"]["reason"]
    assert summary["precision"]["cpu"]["flags"] == ["avx2", "fma"]
    assert "dtype float32 (auto on cpu): this CPU has no bf16 instructions" in capsys.readouterr().out

    cpu(SAPPHIRE_RAPIDS)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("tune_tree", overrides=[f"export_dir={folder}", "prompts.source=jsonl", f"prompts.path={prompts}",
                                              "max_new_tokens=6", "topk=2", "latency_sizes=[1,2]",
                                              "context_length=8", "repeats=1", "max_nodes=3"])
    tune(cfg)
    profile = json.loads((folder / "latency_profile.json").read_text())
    assert profile["dtype"] == "bfloat16" and profile["precision"]["dtype"] == "bfloat16"
    assert "amx_bf16" in profile["precision"]["reason"] and "amx_bf16" in profile["precision"]["cpu"]["flags"]
    assert profile["cpu_kernels"]["kernels"] in ("onednn_packed", "pytorch")

    # the tree is now tuned on bf16 latency: decoding it in fp32 is named
    with pytest.warns(RuntimeWarning, match=r"tuned on other latency: dtype bfloat16 \(tuned\) vs float32"):
        evaluate(_eval_config(folder, prompts, tmp_path / "fp32", "dtype=float32"))


def test_eval_refuses_float16_on_a_cpu_before_loading(export, tmp_path, monkeypatch):
    import medusa_train.loading.export as loading
    from inference.evaluation.eval_run import evaluate

    folder, prompts = export
    monkeypatch.setattr(loading, "load_base_model", lambda cfg: pytest.fail("the base model was loaded"))
    with pytest.raises(ValueError, match="dtype=float16 on the CPU"):
        evaluate(_eval_config(folder, prompts, tmp_path / "run", "dtype=float16"))


def test_eval_with_bf16_forced_on_an_avx2_cpu_warns_and_records_it(export, tmp_path, cpu):
    from inference.evaluation.eval_run import evaluate

    folder, prompts = export
    cpu(AVX2_ONLY)
    with pytest.warns(RuntimeWarning, match="about 3x slower"):
        summary = evaluate(_eval_config(folder, prompts, tmp_path / "run", "dtype=bfloat16"))
    assert summary["dtype"] == "bfloat16" and summary["precision"]["warning"] == BF16_WITHOUT_INSTRUCTIONS
