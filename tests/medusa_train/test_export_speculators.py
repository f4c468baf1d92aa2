"""An EAGLE-3 drafter's ``speculators/`` export: the config vLLM 0.32 reads, the tensors under the names its
``Eagle3LlamaForCausalLM`` loads, and every tensor vLLM would not load refused by name before anything is written; a
``speculators/`` folder changed after the export (tensors, bytes, another weights file) refused by name before vLLM
or llama.cpp's converter is reached. (The real vLLM serving it: ``tests/inference/test_vllm_eagle3.py``.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa_train.models.catalog import drafter_type, new_spec
from medusa_train.drafters.eagle3.drafter import Eagle3Drafter
from medusa_train.export import save_export
from medusa_train.drafters.eagle3.speculators import NORM_FLAGS, expected_tensors
from medusa_train.models.features import layer_feature, target_features
from tests.conftest import VOCAB, make_tiny_model

HEAD_VOCAB = 40


def drafter(target, feature_layers=None, head_vocab: int | None = HEAD_VOCAB, seed: int = 0) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for ``target`` (an 8-layer tiny Llama: default taps (2, 4, 5))."""
    options = {} if feature_layers is None else {"feature_layers": feature_layers}
    spec = new_spec("eagle3", options, target.config, num_heads=3, num_layers=1, hidden_size=target.config.hidden_size,
                    vocab_size=VOCAB, head_vocab_size=head_vocab)
    gen = torch.Generator().manual_seed(seed)
    token_map = None if head_vocab is None else torch.sort(torch.randperm(VOCAB, generator=gen)[:head_vocab]).values
    module = Eagle3Drafter(spec, token_map)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(num_hidden_layers=8)


def test_eagle3_export_writes_speculators_for_vllm(tmp_path, target):
    heads = drafter(target)
    out = save_export(heads, tmp_path / "export", "org/tiny-llama", vllm=True, base_model=target)
    config = json.loads((out / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's (2, L // 2, L - 3) for L = 8
    assert config["draft_vocab_size"] == HEAD_VOCAB and config["target_hidden_size"] == target.config.hidden_size
    assert {k: config[k] for k in NORM_FLAGS} == {"norm_before_residual": False, "norm_before_fc": False,
                                                 "fc_norm": False, "norm_output": False}
    method = config["speculators_config"]["proposal_methods"][0]
    assert method["proposal_type"] == "greedy" and method["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-llama",
                                                        "architectures": ["LlamaForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("llama", 1, VOCAB)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (4, 2, 8)

    tensors = load_file(str(out / "speculators" / "model.safetensors"))
    table = expected_tensors(heads.spec, torch.float32)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == table
    assert table["fc.weight"][0] == (32, 96) and table["midlayer.self_attn.q_proj.weight"][0] == (32, 64)
    assert torch.equal(tensors["d2t"] + torch.arange(HEAD_VOCAB), heads.token_map)  # target id = draft id + d2t
    assert torch.equal(tensors["t2d"].nonzero().flatten(), heads.token_map)
    assert torch.equal(tensors["midlayer.mlp.down_proj.weight"], heads.midlayer.mlp.down_proj.weight)
    assert not (out / "vllm").exists()  # vLLM's Medusa layout is for Medusa heads only
    assert (out / drafter_type("eagle3").weights_file).is_file()


def test_full_vocabulary_drafter_has_no_d2t(tmp_path, target):
    out = save_export(drafter(target, head_vocab=None), tmp_path / "export", "org/tiny", base_model=target)
    tensors = load_file(str(out / "speculators" / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors and tensors["lm_head.weight"].shape == (VOCAB, 32)


def test_unsorted_taps_are_written_in_vllms_ascending_order(tmp_path, target):
    """vLLM concatenates the taps in ascending layer order: fc's column blocks follow, so the fused feature is ours."""
    heads = drafter(target, feature_layers=(5, 1, 3))
    out = save_export(heads, tmp_path / "export", "org/tiny", base_model=target)
    config = json.loads((out / "speculators" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    fc = load_file(str(out / "speculators" / "model.safetensors"))["fc.weight"]
    ids = torch.tensor([[3, 7, 11, 13]])
    with torch.no_grad():
        features, _ = target_features(target.model, ids, layers=(1, 3, 5))
        ours = heads.fuse([features[layer_feature(i)] for i in heads.spec.feature_layers])
        vllms = torch.cat([features[layer_feature(i)] for i in (1, 3, 5)], dim=-1) @ fc.T
    assert not torch.equal(fc, heads.fc.weight)
    torch.testing.assert_close(vllms, ours)


def _edited_state(heads, edit):
    state = heads.state_dict()

    def patched(*args, **kwargs):
        return edit(dict(state))
    return patched


@pytest.mark.parametrize("edit, message", [
    (lambda s: {("midlayer.self_attn.qkv.weight" if k == "midlayer.self_attn.q_proj.weight" else k): v
                for k, v in s.items()},
     r"midlayer\.self_attn\.q_proj\.weight is missing.*midlayer\.self_attn\.qkv\.weight \[32, 64\] is not a tensor "
     r"vLLM's Eagle3LlamaForCausalLM reads"),
    (lambda s: {**s, "midlayer.mlp.up_proj.weight": s["midlayer.mlp.up_proj.weight"][:, :16]},
     r"midlayer\.mlp\.up_proj\.weight is \[64, 16\] float32, vLLM reads \[64, 32\] float32"),
    (lambda s: {k: v for k, v in s.items() if k != "token_map"}, r"d2t is missing \(vLLM reads \[40\] int64\)"),
], ids=["renamed", "reshaped", "no_d2t"])
def test_a_tensor_vllm_would_not_load_is_refused_by_name_before_writing(tmp_path, target, monkeypatch, edit, message):
    out = tmp_path / "export"
    save_export(drafter(target), out, "org/tiny", base_model=target)
    before = {p.name: p.read_bytes() for p in (out / "speculators").iterdir()}
    heads = drafter(target, seed=1)
    monkeypatch.setattr(heads, "state_dict", _edited_state(heads, edit))
    with pytest.raises(ValueError, match=message):
        save_export(heads, out, "org/tiny", base_model=target)
    assert {p.name: p.read_bytes() for p in (out / "speculators").iterdir()} == before  # the old export untouched


def test_a_tap_at_the_last_layer_is_refused_for_vllm(tmp_path, target):
    heads = drafter(target, feature_layers=(2, 4, 8))
    with pytest.raises(ValueError, match=r"heads\.feature_layers=\[2, 4, 8\] reads layer 8.*before the final norm"):
        save_export(heads, tmp_path / "export", "org/tiny", base_model=target)
    assert not (tmp_path / "export").exists()
    out = save_export(heads, tmp_path / "export", "org/tiny", vllm=False, base_model=target)
    assert not (out / "speculators").exists()


def test_a_medusa_export_into_the_folder_drops_the_stale_speculators(tmp_path, target):
    from medusa_train.models.heads_base import HeadsSpec
    from medusa_train.drafters.medusa.heads import MedusaHeads

    out = save_export(drafter(target), tmp_path / "export", "org/tiny", base_model=target)
    assert (out / "speculators" / "config.json").is_file()
    medusa = MedusaHeads(HeadsSpec(2, 1, 32, VOCAB))
    save_export(medusa, out, "org/tiny", base_model=target)
    assert not (out / "speculators").exists() and (out / "vllm" / "config.json").is_file()


# ---- speculators/ changed after the export: refused before vLLM or llama.cpp reads it -------------------------------

def _retensor(edit):
    """A tampering of speculators/model.safetensors: its tensors rewritten through ``edit``."""
    def tamper(folder):
        path = folder / "model.safetensors"
        save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})
    return tamper


def _same_size(name, offset, new: bytes):
    """A tampering that overwrites bytes of ``name`` in place: the file keeps its size."""
    def tamper(folder):
        path = folder / name
        data = bytearray(path.read_bytes())
        at = data.index(offset) if isinstance(offset, bytes) else offset
        data[at:at + len(new)] = new
        path.write_bytes(bytes(data))
    return tamper


def _weights_beside(folder):
    save_file({"fc.weight": torch.zeros(2, 2)}, str(folder / "model-00002.safetensors"))


TAMPERINGS = {
    "reshaped": (_retensor(lambda s: {**s, "fc.weight": s["fc.weight"][:, :64].contiguous()}),
                 r"speculators/model\.safetensors does not hold this export's EAGLE-3 drafter \(.*/config\.json\): "
                 r"fc\.weight is \[32, 64\] float32, vLLM reads \[32, 96\] float32; vLLM and llama\.cpp read this "
                 r"file as it is: re-export the drafter \(export_vllm=true\) to write speculators/ again"),
    "dropped": (_retensor(lambda s: {k: v for k, v in s.items() if k != "norm.weight"}),
                r"speculators/model\.safetensors does not hold .*: norm\.weight is missing \(vLLM reads \[32\] "
                r"float32\);"),
    "added": (_retensor(lambda s: {**s, "midlayer.extra.weight": torch.zeros(3)}),
              r"speculators/model\.safetensors does not hold .*: midlayer\.extra\.weight \[3\] is not a tensor vLLM's "
              r"Eagle3LlamaForCausalLM reads;"),
    "bytes_edited": (_same_size("model.safetensors", -64, b"\x7f" * 16),
                     r"speculators/model\.safetensors is not the file this export wrote: its sha256 differs from the "
                     r"one .*/config\.json recorded \(engine_files_sha256\), so it was changed since \(edited or "
                     r"damaged\); vLLM and llama\.cpp would read it as it is: re-export the drafter"),
    "config_edited": (_same_size("config.json", b'"speculative_tokens": 3', b'"speculative_tokens": 9'),
                      r"speculators/config\.json is not the file this export wrote: its sha256 differs"),
    "weights_beside": (_weights_beside,
                       r"speculators holds model-00002\.safetensors beside model\.safetensors: vLLM loads every "
                       r"\*\.safetensors file there as the drafter's weights; remove them, or re-export the drafter"),
}


@pytest.fixture
def no_engine(monkeypatch):
    """vLLM's worker and llama.cpp's converter fail the test if anything reaches them."""
    import medusa_train.drafters.eagle3.gguf as gguf
    import medusa_train.engines.vllm_env as vllm_env

    monkeypatch.setattr(vllm_env, "VllmWorker", lambda *a, **k: pytest.fail("vLLM started"))
    monkeypatch.setattr(gguf, "converter_command", lambda: pytest.fail("llama.cpp's converter looked for"))
    monkeypatch.setenv("MEDUSA_LLAMACPP_DIR", "/nonexistent/llamacpp")  # medusa-export-gguf's own check


def serve_in_vllm(export, target):
    """The vllm_eagle3 decoder's build (medusa-eval's and serve_vllm.py's path to vLLM) for the target ``target``."""
    from types import SimpleNamespace

    from inference.registry import BuildContext, build_decoder, decoder_settings
    from medusa_train.config.schema import ModelConfig

    ctx = BuildContext(model=SimpleNamespace(base=target), tokenizer=None, export_dir=str(export),
                       model_config=ModelConfig(name_or_path="org/tiny"))
    return build_decoder("vllm_eagle3", decoder_settings("vllm_eagle3", None), ctx)


@pytest.mark.parametrize("tampering", sorted(TAMPERINGS))
def test_a_tampered_speculators_folder_is_refused_by_name_before_vllm_or_llamacpp(tmp_path, target, no_engine,
                                                                                 tampering):
    """A reshaped, dropped or added tensor, an edit of the same size (weights or config) or another weights file
    beside them: the vllm_eagle3 rows (the decoder's build), medusa-export-gguf and the llama.cpp conversion each
    refuse the export naming the file and the fix, before any engine or converter is reached."""
    from medusa_train.drafters.eagle3.gguf import export_eagle3_gguf
    from tests.medusa_train.test_cli import export_gguf

    out = save_export(drafter(target), tmp_path / "export", "org/tiny", base_model=target)
    tamper, message = TAMPERINGS[tampering]
    tamper(out / "speculators")
    with pytest.raises(ValueError, match=r"^decoder\.vllm_eagle3: " + str(out) + "/" + message):
        serve_in_vllm(out, target)
    with pytest.raises(ValueError, match=r"^" + str(out) + "/" + message):
        export_gguf(f"export_dir={out}")
    with pytest.raises(ValueError, match=r"^" + str(out) + "/" + message):
        export_eagle3_gguf(out, tmp_path)
    assert not (out / "llamacpp").exists()


def test_the_export_records_the_served_files_sha256_and_an_untampered_folder_is_served(tmp_path, target, no_engine,
                                                                                       caplog):
    import hashlib

    out = save_export(drafter(target), tmp_path / "export", "org/tiny", base_model=target)
    recorded = json.loads((out / "config.json").read_text())["engine_files_sha256"]
    assert recorded == {name: hashlib.sha256(name.rsplit("/", 1)[1].encode() + b"\0" + (out / name).read_bytes())
                        .hexdigest() for name in ("speculators/config.json", "speculators/model.safetensors")}
    with pytest.raises(pytest.fail.Exception, match="vLLM started"):  # every check passed
        serve_in_vllm(out, target)
    config = json.loads((out / "config.json").read_text())
    del config["engine_files_sha256"]  # an export written before the record: the tensors alone are checked
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(pytest.fail.Exception, match="vLLM started"):
        serve_in_vllm(out, target)
    assert "records no sha256 of speculators/ (engine_files_sha256; exported before it was recorded)" in caplog.text
    _retensor(lambda s: {k: v for k, v in s.items() if k != "d2t"})(out / "speculators")
    with pytest.raises(ValueError, match=r"d2t is missing \(vLLM reads \[40\] int64\)"):
        serve_in_vllm(out, target)
