"""An EAGLE-3 drafter for a Qwen2 target with Qwen2.5's 151,936-token vocabulary (a tiny random target here), exported
for vLLM (``speculators/``) and read back: the config names the Qwen2 verifier, the draft vocabulary's ``d2t`` maps
into the large vocabulary, and the weights read back equal the drafter's. With llama.cpp installed and the real
Qwen2.5-Coder tokenizer at hand (``bash launch/install_models.sh coder``), llama.cpp's own converter turns it into a
GGUF whose tensors and vocabulary are read back; that part skips, naming the command, where either is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from medusa_train.models.catalog import new_spec
from medusa_train.drafters.eagle3.drafter import Eagle3Drafter
from medusa_train.drafters.eagle3.gguf import export_eagle3_gguf
from medusa_train.engines.llamacpp_env import llamacpp_available, llamacpp_venv
from medusa_train.export import load_heads, save_export
from tests.conftest import make_tiny_model

QWEN_VOCAB = 151_936
DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen2 (8 layers, hidden 32) with Qwen2.5's vocabulary size."""
    return make_tiny_model("qwen2", vocab_size=QWEN_VOCAB, num_hidden_layers=8)


@pytest.fixture(scope="module")
def export(target, tmp_path_factory) -> Path:
    spec = new_spec("eagle3", {}, target.config, num_heads=3, num_layers=1, hidden_size=32, vocab_size=QWEN_VOCAB,
                    head_vocab_size=DRAFT_VOCAB)
    gen = torch.Generator().manual_seed(0)
    token_map = torch.sort(torch.randperm(QWEN_VOCAB, generator=gen)[:DRAFT_VOCAB]).values  # ids spread over 152k
    drafter = Eagle3Drafter(spec, token_map)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return save_export(drafter, tmp_path_factory.mktemp("qwen") / "export", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                       vllm=True, base_model=target)


def test_the_speculators_export_of_a_qwen2_target_reads_back(export, target):
    config = json.loads((export / "speculators" / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                                                        "architectures": ["Qwen2ForCausalLM"]}
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["transformer_layer_config"]["vocab_size"] == QWEN_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    tensors = load_file(str(export / "speculators" / "model.safetensors"))
    heads, _ = load_heads(export)
    d2t = tensors["d2t"]
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)
    target_ids = torch.arange(DRAFT_VOCAB) + d2t  # target id = draft id + d2t[draft id]
    assert torch.equal(target_ids, heads.token_map) and int(target_ids.max()) > 100_000  # the large ids reached
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, 32)
    assert torch.equal(tensors["lm_head.weight"], heads.lm_head.weight)
    assert "embed_tokens.weight" not in tensors  # vLLM shares the target's embedding (the whole vocabulary)


def coder_tokenizer_folder() -> Path:
    """The converted Qwen2.5-Coder-1.5B HF folder (its tokenizer), or a skip naming the install command."""
    from medusa_train.loading.chunked_gguf import NotInstalledError, installed_gguf
    from medusa_train.cli.install_models import preset_config
    from medusa_train.loading.base import engine_model_path

    try:
        installed_gguf("qwen2_5_coder_1_5b")
    except NotInstalledError as e:
        pytest.skip(str(e))
    return Path(engine_model_path(preset_config("qwen2_5_coder_1_5b")))


@pytest.mark.skipif(not llamacpp_available(), reason="llama.cpp is not installed: run `bash launch/install_llamacpp.sh`")
@pytest.mark.slow
def test_llamacpps_converter_turns_it_into_a_gguf_that_reads_back(export, target, tmp_path):
    import subprocess

    folder = tmp_path / "target"
    folder.mkdir()
    target.config.save_pretrained(folder)  # the tiny target's config; the real Qwen tokenizer beside it
    real = coder_tokenizer_folder()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((real / name).read_bytes())
    gguf = export_eagle3_gguf(export, folder)
    script = ("import json, sys, gguf\nr = gguf.GGUFReader(sys.argv[1])\n"
              "print(json.dumps({'tensors': {t.name: [int(x) for x in t.shape] for t in r.tensors},"
              " 'tokens': len(r.fields['tokenizer.ggml.tokens'].data)}))")
    done = subprocess.run([str(llamacpp_venv() / "bin" / "python"), "-c", script, str(gguf)], capture_output=True,
                          text=True, check=True)
    read = json.loads(done.stdout)
    assert read["tokens"] == QWEN_VOCAB  # the target's vocabulary, from the real tokenizer
    shapes = read["tensors"]
    assert shapes["d2t"] == [DRAFT_VOCAB] and shapes["output.weight"] == [32, DRAFT_VOCAB]  # GGUF lists dims reversed
    assert any(name.startswith("blk.0.") for name in shapes)
