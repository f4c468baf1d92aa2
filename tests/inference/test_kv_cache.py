"""KV-cache compaction on hand-made DynamicCache tensors: exact positions kept, in order, in every layer."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from inference.kv_cache import cache_length, check_compactable, crop, keep_positions, keep_tree_nodes, select_rows


def _cache(layers: int = 2, batch: int = 1, heads: int = 2, length: int = 7, dim: int = 3) -> DynamicCache:
    """Layer l holds keys[b, h, t, :] = 1000 l + 100 b + 10 h + t and values = -keys, so positions are readable."""
    cache = DynamicCache()
    t = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1)
    for layer in range(layers):
        keys = (1000 * layer + 100 * torch.arange(batch).view(batch, 1, 1, 1)
                + 10 * torch.arange(heads).view(1, heads, 1, 1) + t).expand(batch, heads, length, dim).clone()
        cache.update(keys, -keys, layer)
    return cache


def _positions(cache: DynamicCache, layer: int = 0) -> list[int]:
    return cache.layers[layer].keys[0, 0, :, 0].long().tolist()


def test_keep_tree_nodes_keeps_past_then_accepted_path_in_every_layer():
    cache = _cache(layers=2, batch=2, heads=2, length=9)  # 4 past + 5 tree nodes
    keep_tree_nodes(cache, past_length=4, accepted_nodes=torch.tensor([0, 2, 4]))
    assert cache_length(cache) == 7
    for layer in range(2):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert keys.shape == (2, 2, 7, 3) and values.shape == (2, 2, 7, 3)
        expected_t = torch.tensor([0, 1, 2, 3, 4, 6, 8], dtype=torch.float32)
        for b in range(2):
            for h in range(2):
                assert torch.equal(keys[b, h, :, 1], 1000 * layer + 100 * b + 10 * h + expected_t)
        assert torch.equal(values, -keys)


def test_keep_positions_per_row():
    cache = _cache(layers=2, batch=2, heads=2, length=8)  # 3 past + 5 tree nodes
    keep_positions(cache, start=3, indices=torch.tensor([[0, 2, 4], [0, 1, 1]]))
    for layer in range(2):
        keys = cache.layers[layer].keys
        assert keys.shape == (2, 2, 6, 3)
        for h in range(2):
            assert keys[0, h, :, 0].tolist() == [1000 * layer + 10 * h + t for t in (0, 1, 2, 3, 5, 7)]
            assert keys[1, h, :, 0].tolist() == [1000 * layer + 100 + 10 * h + t for t in (0, 1, 2, 3, 4, 4)]
        assert torch.equal(cache.layers[layer].values, -keys)


def test_select_rows():
    cache = _cache(layers=2, batch=3, length=4)
    select_rows(cache, torch.tensor([2, 0]))
    keys = cache.layers[1].keys
    assert keys.shape == (2, 2, 4, 3)
    assert keys[:, 0, 0, 0].tolist() == [1200, 1000]


def test_keep_positions_overlapping_move_and_identity():
    cache = _cache(length=6)
    keep_positions(cache, start=1, indices=torch.tensor([1, 2, 3]))  # sources 2,3,4 overlap targets 1,2,3
    assert _positions(cache) == [0, 2, 3, 4]
    keep_positions(cache, start=2, indices=torch.tensor([0]))  # root only: drop the tail
    assert _positions(cache) == [0, 2, 3]
    keep_positions(cache, start=3, indices=torch.tensor([], dtype=torch.long))
    assert _positions(cache) == [0, 2, 3]


def test_the_cache_keeps_growing_after_compaction():
    cache = _cache(length=5)
    keep_positions(cache, start=2, indices=torch.tensor([2]))
    extra = torch.full((1, 2, 2, 3), 77.0)
    keys, _ = cache.update(extra, -extra, 0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 4, 77, 77]
    assert cache.get_seq_length() == 5


def test_crop():
    cache = _cache(length=6)
    crop(cache, 4)
    assert _positions(cache) == [0, 1, 2, 3] and _positions(cache, 1) == [1000, 1001, 1002, 1003]
    crop(cache, 4)
    assert cache_length(cache) == 4
    with pytest.raises(ValueError, match="crop length"):
        crop(cache, 5)


def test_bad_indices_are_refused():
    cache = _cache(length=5)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        keep_positions(cache, start=2, indices=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\[n\] or \[B, n\]"):
        keep_positions(cache, start=2, indices=torch.tensor([[[0]]]))
    with pytest.raises(ValueError, match="2 rows but the cache batch is 1"):
        keep_positions(cache, start=2, indices=torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="start"):
        keep_positions(cache, start=6, indices=torch.tensor([0]))
    assert cache_length(cache) == 5


def test_sliding_window_layers_are_refused():
    cache = DynamicCache()
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        check_compactable(cache)
