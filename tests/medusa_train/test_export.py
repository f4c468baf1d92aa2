"""Export and load of Medusa heads: FasterDecoding and vLLM layouts, exact round trips, strict loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from medusa_train.export import load_heads, read_export_config, save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from tests.conftest import HIDDEN, VOCAB, make_tiny_model

TOKEN_MAP = torch.tensor([0, 2, 5, 11, 17, 40, 41, 96])  # V' = 8 of V = 97


@pytest.fixture(scope="module")
def base() -> nn.Module:
    return make_tiny_model("llama")


def random_heads(num_heads: int = 2, num_layers: int = 1, share: bool = False, token_map: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> MedusaHeads:
    spec = HeadsSpec(num_heads, num_layers, HIDDEN, VOCAB, share_lm_head=share,
                     head_vocab_size=None if token_map is None else token_map.numel())
    return randomized(MedusaHeads(spec, token_map=token_map), seed, dtype)


def randomized(heads: torch.nn.Module, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """``heads`` with every parameter drawn from N(0, 0.3^2) (seeded), in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return heads.to(dtype)


def hidden_states(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)


def rewrite(path: Path, edit) -> None:
    state = load_file(path)
    edit(state)
    save_file(state, path)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_map", [None, TOKEN_MAP], ids=["full_vocab", "token_map"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("share", [False, True])
def test_round_trip_gives_identical_logits(tmp_path, base, share, num_layers, token_map, dtype):
    heads = random_heads(3, num_layers, share, token_map, dtype)
    save_export(heads, tmp_path / "export", "tiny-llama", base_model=base)
    lm_head = base.lm_head.weight
    expected = heads(hidden_states(dtype), lm_head)
    assert expected.shape == (3, 2, 5, VOCAB if token_map is None else 8)
    for folder, fmt in ((tmp_path / "export", "medusa-train"), (tmp_path / "export" / "vllm", "vllm")):
        loaded, config = load_heads(folder, base_model=base)
        assert loaded.spec == heads.spec
        assert config["source_format"] == fmt
        assert loaded.block_weight.dtype == dtype
        assert torch.equal(loaded(hidden_states(dtype), lm_head), expected)
        if token_map is None:
            assert loaded.token_map is None
        else:
            assert torch.equal(loaded.token_map, token_map) and loaded.token_map.dtype == torch.long


def test_load_casts_to_requested_dtype(tmp_path):
    heads = random_heads(2, 1)
    save_export(heads, tmp_path, "tiny-llama")
    loaded, _ = load_heads(tmp_path, dtype=torch.bfloat16)
    assert loaded.block_weight.dtype == loaded.lm_head_weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head_weight, heads.lm_head_weight.to(torch.bfloat16))
    assert loaded.block_weight.requires_grad  # loaded heads can be trained further


# ---------------------------------------------------------------- the files themselves


def test_fasterdecoding_keys_vllm_keys_and_configs(tmp_path, base):
    heads = random_heads(2, 1, token_map=TOKEN_MAP)
    save_export(heads, tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", extra_config={"dataset": "sharegpt"},
                base_model=base)

    fd = load_file(tmp_path / "medusa_lm_head.safetensors")
    assert sorted(fd) == ["0.0.linear.bias", "0.0.linear.weight", "0.1.weight",
                          "1.0.linear.bias", "1.0.linear.weight", "1.1.weight"]
    assert fd["1.0.linear.weight"].shape == (HIDDEN, HIDDEN) and torch.equal(fd["1.0.linear.weight"],
                                                                             heads.block_weight[1, 0])
    assert torch.equal(fd["0.0.linear.bias"], heads.block_bias[0, 0])
    assert fd["1.1.weight"].shape == (8, HIDDEN) and torch.equal(fd["1.1.weight"], heads.lm_head_weight[1])
    token_map = load_file(tmp_path / "token_map.safetensors")
    assert list(token_map) == ["token_map"] and token_map["token_map"].dtype == torch.int64
    assert token_map["token_map"].tolist() == TOKEN_MAP.tolist()

    vllm = load_file(tmp_path / "vllm" / "model.safetensors")
    assert sorted(vllm) == ["blocks.0.layers.0.bias", "blocks.0.layers.0.weight", "blocks.1.layers.0.bias",
                            "blocks.1.layers.0.weight", "lm_heads.0.weight", "lm_heads.1.weight",
                            "medusa_train.token_map"]
    assert torch.equal(vllm["blocks.1.layers.0.weight"], heads.block_weight[1, 0])
    assert torch.equal(vllm["medusa_train.token_map"], TOKEN_MAP)
    # vLLM 0.32 needs all V rows and cannot load a token map: the head's rows at the token map, their mean elsewhere.
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[TOKEN_MAP] = False
    for h in range(2):
        assert vllm[f"lm_heads.{h}.weight"].shape == (VOCAB, HIDDEN)
        assert torch.equal(vllm[f"lm_heads.{h}.weight"][TOKEN_MAP], heads.lm_head_weight[h])
        mean = heads.lm_head_weight[h].mean(dim=0)
        assert torch.equal(vllm[f"lm_heads.{h}.weight"][off], mean.expand(VOCAB - 8, HIDDEN))

    assert read_export_config(tmp_path) == {
        "medusa_num_heads": 2, "medusa_num_layers": 1, "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "share_lm_head": False, "version": 1,
        "head_vocab_size": 8, "torch_dtype": "float32", "medusa_train_version": "0.1.0",
        "base_model_class": "LlamaForCausalLM", "base_model_type": "llama", "dataset": "sharegpt",
    }
    assert json.loads((tmp_path / "vllm" / "config.json").read_text()) == {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "num_heads": 2, "num_hidden_layers": 1, "max_paths": 64, "topk": 10, "truncated_vocab_size": VOCAB,
        "original_lm_head": False, "medusa_fc_bias": True, "torch_dtype": "float32",
        "medusa_train_head_vocab_size": 8,
    }


def test_shared_lm_head_writes_blocks_only_and_one_vllm_lm_head(tmp_path, base):
    heads = random_heads(2, 1, share=True)
    save_export(heads, tmp_path, "tiny-llama", base_model=base)
    assert sorted(load_file(tmp_path / "medusa_lm_head.safetensors")) == [
        "0.0.linear.bias", "0.0.linear.weight", "1.0.linear.bias", "1.0.linear.weight"]
    vllm = load_file(tmp_path / "vllm" / "model.safetensors")
    assert sorted(vllm) == ["blocks.0.layers.0.bias", "blocks.0.layers.0.weight", "blocks.1.layers.0.bias",
                            "blocks.1.layers.0.weight", "lm_heads.0.weight"]
    assert torch.equal(vllm["lm_heads.0.weight"], base.lm_head.weight)
    assert read_export_config(tmp_path)["share_lm_head"] is True
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["original_lm_head"] is True


def test_reexport_keeps_other_files_and_drops_stale_ones(tmp_path):
    save_export(random_heads(2, 1, token_map=TOKEN_MAP, seed=0), tmp_path, "tiny-llama")
    choices = '[[0], [0, 0], [1]]\n'
    (tmp_path / "medusa_choices.json").write_text(choices)
    assert (tmp_path / "token_map.safetensors").exists() and (tmp_path / "vllm").is_dir()

    new = random_heads(3, 2, seed=5)
    save_export(new, tmp_path, "tiny-llama", vllm=False)
    assert (tmp_path / "medusa_choices.json").read_text() == choices
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "medusa_choices.json",
                                                          "medusa_lm_head.safetensors"]
    loaded, config = load_heads(tmp_path)
    assert config["medusa_num_heads"] == 3 and config["head_vocab_size"] is None
    assert torch.equal(loaded(hidden_states()), new(hidden_states()))


# ---------------------------------------------------------------- FasterDecoding's own module


class ResBlock(nn.Module):
    """FasterDecoding's ResBlock (medusa/model/medusa_model.py): ``x + SiLU(Linear(x))``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def fasterdecoding_heads(num_heads: int, num_layers: int, hidden: int, vocab: int,
                         shared_blocks: bool = True) -> nn.ModuleList:
    """FasterDecoding's ``medusa_head``; it builds the blocks by list multiplication (``shared_blocks``), so with
    num_layers > 1 one block is reused; ``shared_blocks=False`` gives each layer its own."""
    def blocks() -> list[nn.Module]:
        return [ResBlock(hidden)] * num_layers if shared_blocks else [ResBlock(hidden) for _ in range(num_layers)]
    return nn.ModuleList([nn.Sequential(*blocks(), nn.Linear(hidden, vocab, bias=False)) for _ in range(num_heads)])


@pytest.mark.parametrize("num_layers,config_has_layers,shared_blocks", [(1, True, True), (2, False, True),
                                                                         (2, True, False)])
def test_loads_fasterdecoding_pt_checkpoint(tmp_path, base, num_layers, config_has_layers, shared_blocks):
    torch.manual_seed(3)
    fd = fasterdecoding_heads(3, num_layers, HIDDEN, VOCAB, shared_blocks)
    with torch.no_grad():
        for p in fd.parameters():
            p.normal_(0, 0.3)
    torch.save(fd.state_dict(), tmp_path / "medusa_lm_head.pt")
    config = {"medusa_num_heads": 3, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    if config_has_layers:
        config["medusa_num_layers"] = num_layers
    (tmp_path / "config.json").write_text(json.dumps(config))

    heads, cfg = load_heads(tmp_path, base_model=base)
    assert heads.spec == HeadsSpec(3, num_layers, HIDDEN, VOCAB)
    assert cfg["source_format"] == "fasterdecoding" and cfg["base_model_name_or_path"] == "lmsys/vicuna-7b-v1.3"
    x = hidden_states()
    with torch.no_grad():
        expected = torch.stack([head(x) for head in fd])
    torch.testing.assert_close(heads(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(heads.lm_head_weight[2], fd[2][num_layers].weight)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_fasterdecoding_module_loads_our_export(tmp_path, num_layers):
    heads = random_heads(3, num_layers)
    save_export(heads, tmp_path, "tiny-llama", vllm=False)
    fd = fasterdecoding_heads(3, num_layers, HIDDEN, VOCAB, shared_blocks=False)
    fd.load_state_dict(load_file(tmp_path / "medusa_lm_head.safetensors"), strict=True)
    x = hidden_states()
    with torch.no_grad():
        torch.testing.assert_close(torch.stack([head(x) for head in fd]), heads(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the vllm/ folder's projections
# (tests/engines/test_vllm_export.py loads it in the real vLLM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [False, True])
def test_vllm_projections_keep_the_heads_top1_over_the_full_vocabulary(tmp_path, base, share, dtype):
    """Out-of-map rows hold the mean of the head's rows, so a V-way argmax of the stored projection is the head's
    own V'-way top-1, even where every head logit is negative (which a zero row would beat)."""
    heads = random_heads(3, 1, share, TOKEN_MAP, dtype)
    save_export(heads, tmp_path, "tiny-llama", base_model=base)
    stored = load_file(tmp_path / "vllm" / "model.safetensors")
    x = torch.randn(400, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    features = heads.transform(x)  # [K, N, H]
    ours = heads.project(features, base.lm_head.weight.to(dtype))  # [K, N, V']
    assert (ours.amax(dim=-1) < 0).any()  # positions where zero rows would win exist
    for k in range(3):
        weight = stored["lm_heads.0.weight" if share else f"lm_heads.{k}.weight"]  # [V, H]
        full = features[k] @ weight.T  # [N, V]
        assert torch.equal(full.argmax(dim=-1), TOKEN_MAP[ours[k].argmax(dim=-1)])


def test_export_refuses_a_head_layout_vllm_cannot_reproduce(tmp_path, base):
    heads = random_heads(2, 1, token_map=torch.tensor([5]))
    with pytest.raises(ValueError, match="head_vocab_size=1: vLLM projects onto all V tokens.*vllm=False"):
        save_export(heads, tmp_path / "refused", "tiny-llama", base_model=base)
    assert not (tmp_path / "refused").exists()  # refused before writing anything
    save_export(heads, tmp_path / "kept", "tiny-llama", vllm=False, base_model=base)
    assert not (tmp_path / "kept" / "vllm").exists()
    # and medusa-train refuses it before loading anything
    from medusa_train.config.schema import DataConfig, HeadsConfig, LoggerConfig, ModelConfig, TrainConfig, TrainerConfig

    def train_config(**kwargs) -> TrainConfig:
        return TrainConfig(model=ModelConfig(name_or_path="tiny-llama"), heads=HeadsConfig(head_vocab_size=1),
                           data=DataConfig(), trainer=TrainerConfig(), logger=LoggerConfig(), output_dir="x", **kwargs)

    with pytest.raises(ValueError, match="export_vllm=true, but head_vocab_size=1.*set export_vllm=false"):
        train_config().validate()
    train_config(export_vllm=False).validate()


# ---------------------------------------------------------------- errors


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_heads(tmp_path / "nowhere")
    no_weights = r"no medusa_lm_head.safetensors or medusa_lm_head.pt in .*: is this an export folder\?"
    with pytest.raises(FileNotFoundError, match=no_weights):
        load_heads(tmp_path)
    save_export(random_heads(token_map=TOKEN_MAP), tmp_path / "a", "tiny-llama", vllm=False)
    (tmp_path / "a" / "token_map.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="token_map.safetensors not found"):
        load_heads(tmp_path / "a")
    (tmp_path / "a" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_heads(tmp_path / "a")


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("1.0.linear.bias"), r"missing keys \['1.0.linear.bias'\], unexpected keys \[\]"),
    (lambda s: s.update({"2.0.linear.weight": torch.zeros(HIDDEN, HIDDEN)}),
     r"missing keys \[\], unexpected keys \['2.0.linear.weight'\]"),
    (lambda s: [s.pop("0.1.weight"), s.pop("1.1.weight")], r"missing keys \['0.1.weight', '1.1.weight'\].*"
     "set share_lm_head: true"),
    (lambda s: s.update({"0.0.linear.weight": torch.zeros(HIDDEN, HIDDEN + 1)}),
     r"0.0.linear.weight: file \(32, 33\), expected \(32, 32\)"),
])
def test_strict_keys_and_shapes(tmp_path, edit, message):
    save_export(random_heads(2, 1), tmp_path, "tiny-llama", vllm=False)
    rewrite(tmp_path / "medusa_lm_head.safetensors", edit)
    with pytest.raises(ValueError, match=message):
        load_heads(tmp_path)


def test_vllm_folder_is_read_strictly(tmp_path):
    save_export(random_heads(2, 1), tmp_path, "tiny-llama")
    rewrite(tmp_path / "vllm" / "model.safetensors", lambda s: s.pop("blocks.1.layers.0.weight"))
    with pytest.raises(ValueError, match=r"missing keys \['blocks.1.layers.0.weight'\]"):
        load_heads(tmp_path / "vllm")


@pytest.mark.parametrize("field,overrides", [("hidden_size", {"hidden_size": 48}), ("vocab_size", {"vocab_size": 101})])
def test_heads_for_another_base_model(tmp_path, field, overrides):
    other = make_tiny_model("llama", **overrides)
    save_export(random_heads(2, 1), tmp_path, "tiny-llama")
    for folder in (tmp_path, tmp_path / "vllm"):
        with pytest.raises(ValueError, match=f"Medusa heads have {field}=.* but the base model"):
            load_heads(folder, base_model=other)
    with pytest.raises(ValueError, match=f"Medusa heads have {field}="):
        save_export(random_heads(2, 1), tmp_path, "tiny-llama", base_model=other)


@pytest.mark.parametrize("name", ["medusa_lm_head.safetensors", "token_map.safetensors", "config.json"])
def test_corrupt_file_names_the_file(tmp_path, name):
    save_export(random_heads(token_map=TOKEN_MAP), tmp_path, "tiny-llama")
    (tmp_path / name).write_bytes(b"\x00\x01 not what it should be")
    with pytest.raises(ValueError, match=name) as info:
        load_heads(tmp_path)
    assert info.value.__cause__ is not None


def test_corrupt_pt_file(tmp_path):
    save_export(random_heads(), tmp_path, "tiny-llama", vllm=False)
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(ValueError, match="medusa_lm_head.pt") as info:
        load_heads(tmp_path)
    assert info.value.__cause__ is not None


def test_export_refuses_bad_requests(tmp_path, base):
    with pytest.raises(ValueError, match="pass base_model="):
        save_export(random_heads(share=True), tmp_path, "tiny-llama")
    with pytest.raises(ValueError, match=r"extra_config may not set \['medusa_num_heads'\]"):
        save_export(random_heads(), tmp_path, "tiny-llama", extra_config={"medusa_num_heads": 9})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_export(random_heads(), tmp_path, "tiny-llama", extra_config={"when": object()})
    assert list(tmp_path.iterdir()) == []  # refused before writing anything


def test_refuses_newer_export_version(tmp_path):
    save_export(random_heads(), tmp_path, "tiny-llama")
    config = read_export_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "version": 2}))
    with pytest.raises(ValueError, match="format version 2 is newer"):
        load_heads(tmp_path)


# ---------------------------------------------------------------- FasterDecoding's medusa_lm_head.pt, non-finite heads


def test_fasterdecoding_pt_holds_the_same_tensors_as_the_safetensors(tmp_path, base):
    heads = random_heads(3, 1)
    save_export(heads, tmp_path, "tiny-llama", base_model=base)
    ours = load_file(tmp_path / "medusa_lm_head.safetensors")
    pt = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    assert sorted(pt) == sorted(ours) and all(torch.equal(pt[k], ours[k]) for k in ours)
    assert torch.equal(pt["2.1.weight"], heads.lm_head_weight[2])
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary sibling, renamed into place


def test_fasterdecoding_pt_of_shared_lm_head_heads_carries_the_base_lm_head_once(tmp_path, base):
    heads = random_heads(3, 1, share=True)
    save_export(heads, tmp_path, "tiny-llama", base_model=base, vllm=False)
    pt = torch.load(tmp_path / "medusa_lm_head.pt", weights_only=True)
    assert sorted(pt) == sorted(f"{h}.{k}" for h in range(3) for k in ("0.linear.bias", "0.linear.weight", "1.weight"))
    for h in range(3):  # FasterDecoding's head h projects with pt[f"{h}.1.weight"]: the base lm_head, as ours
        assert torch.equal(pt[f"{h}.1.weight"], base.lm_head.weight)
    assert pt["0.1.weight"].untyped_storage().data_ptr() == pt["2.1.weight"].untyped_storage().data_ptr()
    # one copy of the [V, H] lm_head in the file, not K
    blocks_only = tmp_path / "blocks.pt"
    torch.save({k: v for k, v in pt.items() if "linear" in k}, blocks_only)
    lm_head_bytes = base.lm_head.weight.numel() * 4
    assert (tmp_path / "medusa_lm_head.pt").stat().st_size - blocks_only.stat().st_size < 1.5 * lm_head_bytes
    with pytest.raises(ValueError, match="pass base_model="):
        save_export(heads, tmp_path / "again", "tiny-llama", vllm=False)
    save_export(heads, tmp_path / "no_pt", "tiny-llama", vllm=False, fasterdecoding=False)
    assert not (tmp_path / "no_pt" / "medusa_lm_head.pt").exists()


@pytest.mark.parametrize("num_layers, token_map", [(2, None), (1, TOKEN_MAP)], ids=["two_layers", "token_map"])
def test_no_pt_where_fasterdecoding_cannot_reproduce_the_heads_and_a_stale_one_is_removed(tmp_path, num_layers,
                                                                                        token_map):
    save_export(random_heads(2, 1), tmp_path, "tiny-llama")
    assert (tmp_path / "medusa_lm_head.pt").is_file()
    save_export(random_heads(2, num_layers, token_map=token_map), tmp_path, "tiny-llama")
    assert not (tmp_path / "medusa_lm_head.pt").exists()
    assert load_heads(tmp_path)[0].spec.num_layers == num_layers


@pytest.mark.parametrize("share", [False, True])
def test_heads_holding_nan_or_inf_are_never_exported(tmp_path, base, share):
    good = random_heads(3, 1, share=share, seed=1)
    save_export(good, tmp_path, "tiny-llama", base_model=base)
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    bad = random_heads(3, 1, share=share, seed=2)
    with torch.no_grad():
        bad.block_weight[2, 0, 1, 3] = float("nan")
        bad.block_bias[1, 0, :2] = float("inf")
    with pytest.raises(ValueError, match=r"1\.0\.linear\.bias \(head 1\): 0 NaN and 2 Inf.*2\.0\.linear\.weight "
                                         r"\(head 2\): 1 NaN and 0 Inf"):
        save_export(bad, tmp_path, "tiny-llama", base_model=base)
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # the good export kept
    if not share:
        with torch.no_grad():
            bad = random_heads(3, 1)
            bad.lm_head_weight[0, 5, 0] = float("-inf")
        with pytest.raises(ValueError, match=r"0\.1\.weight \(head 0\): 0 NaN and 1 Inf"):
            save_export(bad, tmp_path / "new", "tiny-llama", base_model=base)
        assert not (tmp_path / "new").exists()


def test_loading_refuses_non_finite_heads_naming_tensor_and_head(tmp_path):
    save_export(random_heads(2, 1), tmp_path, "tiny-llama")

    def poison(state):
        state["1.0.linear.weight"][0, 0] = float("nan")

    rewrite(tmp_path / "medusa_lm_head.safetensors", poison)
    with pytest.raises(ValueError, match=r"medusa_lm_head\.safetensors: the heads hold non-finite weights "
                                         r"\(1\.0\.linear\.weight \(head 1\): 1 NaN"):
        load_heads(tmp_path)
    rewrite(tmp_path / "vllm" / "model.safetensors", lambda s: s["lm_heads.0.weight"].fill_(float("inf")))
    with pytest.raises(ValueError, match=r"lm_heads\.0\.weight \(head 0\): 0 NaN and \d+ Inf"):
        load_heads(tmp_path / "vllm")
