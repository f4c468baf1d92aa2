"""KV-cache compaction on hand-made caches (transformers' DynamicCache and our preallocated one): exact positions
kept, in order, in every layer; the preallocated cache writes in place and grows when it must."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from medusa_train.tree.kv_cache import (
    PreallocatedCache,
    PreallocatedLayer,
    cache_length,
    check_compactable,
    crop,
    keep_positions,
    keep_tree_nodes,
    preallocated_cache,
    request_cache,
    select_rows,
)
from tests.conftest import make_tiny_model

KINDS = pytest.mark.parametrize("kind", ["dynamic", "preallocated"])


def _cache(layers: int = 2, batch: int = 1, heads: int = 2, length: int = 7, dim: int = 3,
           kind: str = "dynamic") -> DynamicCache:
    """Layer l holds keys[b, h, t, :] = 1000 l + 100 b + 10 h + t and values = -keys, so positions are readable.
    ``kind="preallocated"``: a :class:`PreallocatedCache` with room for two positions more than it holds."""
    cache = DynamicCache() if kind == "dynamic" else preallocated_cache(length + 2)
    t = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1)
    for layer in range(layers):
        keys = (1000 * layer + 100 * torch.arange(batch).view(batch, 1, 1, 1)
                + 10 * torch.arange(heads).view(1, heads, 1, 1) + t).expand(batch, heads, length, dim).clone()
        cache.update(keys, -keys, layer)
    return cache


def _positions(cache: DynamicCache, layer: int = 0) -> list[int]:
    return cache.layers[layer].keys[0, 0, :, 0].long().tolist()


@KINDS
def test_keep_tree_nodes_keeps_past_then_accepted_path_in_every_layer(kind):
    cache = _cache(layers=2, batch=2, heads=2, length=9, kind=kind)  # 4 past + 5 tree nodes
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


@KINDS
def test_keep_positions_per_row(kind):
    cache = _cache(layers=2, batch=2, heads=2, length=8, kind=kind)  # 3 past + 5 tree nodes
    keep_positions(cache, start=3, indices=torch.tensor([[0, 2, 4], [0, 1, 1]]))
    for layer in range(2):
        keys = cache.layers[layer].keys
        assert keys.shape == (2, 2, 6, 3)
        for h in range(2):
            assert keys[0, h, :, 0].tolist() == [1000 * layer + 10 * h + t for t in (0, 1, 2, 3, 5, 7)]
            assert keys[1, h, :, 0].tolist() == [1000 * layer + 100 + 10 * h + t for t in (0, 1, 2, 3, 4, 4)]
        assert torch.equal(cache.layers[layer].values, -keys)


@KINDS
def test_select_rows(kind):
    cache = _cache(layers=2, batch=3, length=4, kind=kind)
    select_rows(cache, torch.tensor([2, 0]))
    keys = cache.layers[1].keys
    assert keys.shape == (2, 2, 4, 3)
    assert keys[:, 0, 0, 0].tolist() == [1200, 1000]


@KINDS
def test_keep_positions_overlapping_move_and_identity(kind):
    cache = _cache(length=6, kind=kind)
    keep_positions(cache, start=1, indices=torch.tensor([1, 2, 3]))  # sources 2,3,4 overlap targets 1,2,3
    assert _positions(cache) == [0, 2, 3, 4]
    keep_positions(cache, start=2, indices=torch.tensor([0]))  # root only: drop the tail
    assert _positions(cache) == [0, 2, 3]
    keep_positions(cache, start=3, indices=torch.tensor([], dtype=torch.long))
    assert _positions(cache) == [0, 2, 3]


@KINDS
def test_the_cache_keeps_growing_after_compaction(kind):
    cache = _cache(length=5, kind=kind)
    keep_positions(cache, start=2, indices=torch.tensor([2]))
    extra = torch.full((1, 2, 2, 3), 77.0)
    keys, _ = cache.update(extra, -extra, 0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 4, 77, 77]
    assert cache.get_seq_length() == 5


@KINDS
def test_crop(kind):
    cache = _cache(length=6, kind=kind)
    crop(cache, 4)
    assert _positions(cache) == [0, 1, 2, 3] and _positions(cache, 1) == [1000, 1001, 1002, 1003]
    crop(cache, 4)
    assert cache_length(cache) == 4
    with pytest.raises(ValueError, match="crop length"):
        crop(cache, 5)


@KINDS
def test_bad_indices_are_refused(kind):
    cache = _cache(length=5, kind=kind)
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


def test_the_preallocated_cache_writes_in_place_and_grows_when_it_must():
    cache = _cache(length=5, kind="preallocated")  # capacity 7
    layer = cache.layers[0]
    assert isinstance(cache, PreallocatedCache) and isinstance(layer, PreallocatedLayer)
    buffer = layer.key_buffer
    assert buffer.shape == (1, 2, 7, 3) and layer.keys.data_ptr() == buffer.data_ptr()
    keep_tree_nodes(cache, past_length=2, accepted_nodes=torch.tensor([0, 2]))  # compaction: an index copy
    assert _positions(cache) == [0, 1, 2, 4] and layer.key_buffer is buffer
    extra = torch.full((1, 2, 3, 3), 77.0)
    cache.update(extra, -extra, 0)  # 4 + 3 = 7: fits
    assert layer.key_buffer is buffer and _positions(cache) == [0, 1, 2, 4, 77, 77, 77]
    cache.update(extra, -extra, 0)  # 10 > 7: grows (doubles), keeps what it held
    assert layer.capacity == 14 and _positions(cache) == [0, 1, 2, 4] + [77] * 6
    assert torch.equal(layer.values, -layer.keys)
    cache.crop(-6)
    assert cache.get_seq_length(0) == 4 and _positions(cache) == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        preallocated_cache(0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_model_decodes_the_same_on_both_caches(family):
    model = make_tiny_model(family, initializer_range=0.3)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    replies = []
    for cache in (DynamicCache(), preallocated_cache(6)):  # 6 < 5 + 12: grows on the way
        token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1)
        reply = [int(token)]
        for _ in range(12):
            token = model(input_ids=token[:, None], cache=cache, use_cache=True).logits[:, -1].argmax(-1)
            reply.append(int(token))
        replies.append(reply)
        assert cache.get_seq_length() == 5 + 12
    assert replies[0] == replies[1]


def test_request_cache_is_preallocated_for_full_attention_only():
    assert isinstance(request_cache(make_tiny_model("llama").config, 16), PreallocatedCache)
    sliding = make_tiny_model("mistral", sliding_window=8).config
    cache = request_cache(sliding, 16)
    assert type(cache) is DynamicCache and not isinstance(cache, PreallocatedCache)
