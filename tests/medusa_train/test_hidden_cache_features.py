"""The hidden-state cache stores exactly the target features a drafter reads; a cache of another version or for other
features is rebuilt once, with a warning."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from medusa_train.data.collate import Collator
from medusa_train.models.features import FINAL, target_features
from medusa_train.training.hidden_cache import (
    CACHE_VERSION,
    CachedHiddenDataset,
    HiddenCollator,
    build_hidden_cache,
)
from medusa_train.training.step import FrozenBase
from tests.conftest import VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
LOGGER = "medusa_train.training.hidden_cache"
SHARD = "train-block-000000"


def _rows() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in (7, 4, 9):
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids[1:] + [-100]})
    return rows


def _build(tiny_llama, rows, folder, features=(FINAL,)):
    (block,) = build_hidden_cache(FrozenBase.of(tiny_llama), rows, folder, split="train", fingerprint="f" * 16,
                                  collator=Collator(pad_token_id=0), batch_size=2, features=features)
    return block


@torch.no_grad()
def test_a_cache_for_final_and_layer1_holds_both_with_their_values(tiny_llama, tmp_path):
    rows = _rows()
    shard = _build(tiny_llama, rows, tmp_path, features=(FINAL, "layer1"))
    with safe_open(str(shard), framework="pt") as f:
        assert sorted(f.keys()) == ["base_argmax.00000", "base_argmax.00001", "hidden.00000", "hidden.00001",
                                    "index", "layer1.00000", "layer1.00001"]
    assert json.loads((tmp_path / f"{SHARD}.json").read_text())["features"] == ["final", "layer1"]
    dataset = CachedHiddenDataset(rows, tmp_path, split="train", fingerprint="f" * 16,
                                  features=(FINAL, "layer1"))
    for i, row in enumerate(rows):
        ids = torch.tensor([row["input_ids"]])
        alone, _ = target_features(tiny_llama.base_model, ids, [1])  # [1, T_i, H]
        item = dataset[i]
        assert sorted(item) == ["base_argmax", "hidden", "input_ids", "labels", "layer1"]
        torch.testing.assert_close(item["hidden"], alone[FINAL][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(item["layer1"], alone["layer1"][0], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(item["layer1"], item["hidden"], atol=1e-2)
        assert torch.equal(item["base_argmax"], tiny_llama(ids).logits[0].argmax(-1))
    batch = HiddenCollator()([dataset[0], dataset[1]])
    assert batch["hidden"].shape == batch["layer1"].shape == (2, 7, 32)
    assert torch.equal(batch["layer1"][1, :4], dataset[1]["layer1"]) and not batch["layer1"][1, 4:].any()
    assert batch["attention_mask"].tolist() == [[1] * 7, [1] * 4 + [0] * 3]
    with pytest.raises(FileNotFoundError, match=r"is built for other target features \(\['final', 'layer1'\], not "
                                                r"\['final'\]\); it is rebuilt at the start of training"):
        CachedHiddenDataset(rows, tmp_path, split="train", fingerprint="f" * 16)


def test_an_old_version_cache_is_rebuilt_once_with_a_warning(tiny_llama, tmp_path, caplog):
    rows = _rows()
    folder = tmp_path / "cache"
    shard = _build(tiny_llama, rows, folder)
    written = shard.read_bytes()
    meta_path = folder / f"{SHARD}.json"
    meta = json.loads(meta_path.read_text())
    old = CACHE_VERSION - 1  # as the previous version wrote it: no feature names
    meta_path.write_text(json.dumps({**{k: v for k, v in meta.items() if k != "features"}, "version": old}))
    (folder / "notes.txt").write_text("mine")
    (tmp_path / "beside.txt").write_text("mine too")
    with pytest.raises(FileNotFoundError, match=rf"written by cache version {old} \(this one is {CACHE_VERSION}\)"):
        CachedHiddenDataset(rows, folder, split="train", fingerprint="f" * 16)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _build(tiny_llama, rows, folder)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"hidden cache: rebuilding {shard} (written by cache version {old} (this one is "
                        f"{CACHE_VERSION}))"]
    assert json.loads(meta_path.read_text())["version"] == CACHE_VERSION
    assert shard.read_bytes() == written
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _build(tiny_llama, rows, folder)  # once: now reused
    assert [r.getMessage() for r in caplog.records] == [f"hidden cache: reusing {shard} (3 rows)"]
    assert (folder / "notes.txt").read_text() == "mine" and (tmp_path / "beside.txt").read_text() == "mine too"


def test_a_cache_built_for_other_features_is_rebuilt_with_a_warning(tiny_llama, tmp_path, caplog):
    rows = _rows()
    shard = _build(tiny_llama, rows, tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _build(tiny_llama, rows, tmp_path, features=(FINAL, "layer2"))
    assert caplog.messages == [f"hidden cache: rebuilding {shard} (built for other target features (['final'], not "
                               "['final', 'layer2']))"]
    with safe_open(str(shard), framework="pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"base_argmax", "hidden", "index", "layer2"}


def test_feature_names_are_checked_before_the_base_runs(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"unknown target feature 'hidden'"):
        _build(tiny_llama, _rows(), tmp_path, features=("hidden",))
    with pytest.raises(ValueError, match=r"name one feature twice"):
        _build(tiny_llama, _rows(), tmp_path, features=(FINAL, FINAL))
    with pytest.raises(ValueError, match=r"layers: layer 5 is out of range for a target with 2 layers"):
        _build(tiny_llama, _rows(), tmp_path, features=("layer5",))
    assert list(tmp_path.iterdir()) == []
