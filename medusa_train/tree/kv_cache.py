"""KV caches for speculative decoding on transformers 5 ``DynamicCache``, and the surgery verification needs.

After a tree pass the cache holds the prompt-and-reply prefix (``past`` positions) followed by one entry per tree
node; only the nodes on the accepted path belong to the sequence. :func:`keep_tree_nodes` moves the accepted
nodes' keys and values to directly follow the prefix and drops the rest, so the next pass sees one contiguous
sequence (Medusa's ``update_inference_inputs``, FasterDecoding/Medusa ``medusa/model/utils.py`` at 10a2697, which
copies into a preallocated buffer).

Two layer kinds, both ``[B, heads, T, head_dim]`` per layer:

- transformers' ``DynamicLayer``: every ``update`` concatenates, copying the whole cache once per forward pass;
- :class:`PreallocatedLayer` (:func:`preallocated_cache`): keys and values live in buffers sized for the request
  (prompt + reply + tree), an ``update`` writes the new positions in place and the layer exposes a view of the
  filled part, as gpt-fast's ``KVCache`` does (pytorch-labs/gpt-fast ``model.py``) but without attending over the
  unfilled slots. Compaction is an index copy inside the buffer and a new length; nothing is reallocated.

Only full-attention layers can be compacted: a sliding-window layer drops old entries by itself and a quantized or
offloaded layer keeps a second copy elsewhere, so those raise ``NotImplementedError``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are written in place into buffers of ``capacity`` slots.

    ``keys`` / ``values`` are views ``[B, heads, length, head_dim]`` of the buffers ``[B, heads, capacity,
    head_dim]``, allocated on the first ``update`` in the states' dtype and device. An update past the capacity
    grows the buffers (doubling, one copy), so a wrong estimate costs time, never correctness.

    Args:
        capacity: slots to allocate (e.g. prompt + ``max_new_tokens`` + the tree's nodes).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.length = 0
        self.key_buffer: Tensor | None = None
        self.value_buffer: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        b, h, _, dk = key_states.shape
        self.key_buffer = key_states.new_empty(b, h, self.capacity, dk)
        self.value_buffer = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.length = 0
        self._expose()
        self.is_initialized = True

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = capacity

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write ``[B, heads, n, head_dim]`` states after the filled slots; returns the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` filled slots (no copy)."""
        if self.is_initialized:
            self.length = length
            self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: drop ``-tokens_to_remove`` positions (a negative number)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of positions to drop, got {tokens_to_remove}")
        self.truncate(max(self.length + tokens_to_remove, 0))

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._expose()

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        self.length = 0
        super().reset()


class PreallocatedCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`PreallocatedLayer` of ``capacity`` slots (created lazily, one per
    attention layer, as ``DynamicCache()`` creates its own). Full attention only: no sliding-window layers."""

    def __init__(self, capacity: int) -> None:
        PreallocatedLayer(capacity)  # checks capacity now rather than at the first update
        Cache.__init__(self, layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity))


def preallocated_cache(capacity: int) -> PreallocatedCache:
    """A cache for one request of at most ``capacity`` positions (more grows it): see :class:`PreallocatedCache`."""
    return PreallocatedCache(capacity)


def request_cache(model_config: Any, capacity: int) -> DynamicCache:
    """The KV cache of one request: :func:`preallocated_cache` when every layer attends fully, transformers'
    ``DynamicCache(config=...)`` otherwise (sliding-window layers drop old entries themselves)."""
    kinds = set(getattr(model_config, "layer_types", None) or ())
    window = getattr(model_config, "sliding_window", None)
    windowed = bool(window) and getattr(model_config, "use_sliding_window", True) is not False
    sliding = bool(kinds - {"full_attention"}) or windowed
    return DynamicCache(config=model_config) if sliding else preallocated_cache(capacity)


_COMPACTABLE = (DynamicLayer, PreallocatedLayer)


def check_compactable(cache: DynamicCache) -> None:
    """Raise ``NotImplementedError`` unless every layer of ``cache`` is a full-attention ``DynamicLayer`` or a
    :class:`PreallocatedLayer`."""
    if not isinstance(cache, DynamicCache):
        raise NotImplementedError(f"KV compaction needs a transformers DynamicCache, got {type(cache).__name__}")
    for i, layer in enumerate(cache.layers):
        if type(layer) not in _COMPACTABLE:
            raise NotImplementedError(
                f"cache layer {i} is a {type(layer).__name__}; KV compaction supports full-attention DynamicLayer "
                "and PreallocatedLayer only (no sliding-window, quantized or offloaded layers)"
            )


def cache_length(cache: DynamicCache) -> int:
    """T, the number of positions the cache holds (0 when empty)."""
    return int(cache.get_seq_length())


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (in place).

    Raises:
        ValueError: ``length`` is negative or longer than the cache.
    """
    current = cache_length(cache)
    if not 0 <= length <= current:
        raise ValueError(f"crop length must be in [0, {current}] (the cache length), got {length}")
    if length < current:
        cache.crop(length - current)  # transformers 5 crops by a negative number of positions to drop


def keep_positions(cache: DynamicCache, start: int, indices: Tensor) -> None:
    """Keep positions ``[0, start)`` and ``start + indices`` (in that order), drop all others (in place).

    Args:
        cache: a compactable ``DynamicCache`` (see :func:`check_compactable`).
        start: positions before ``start`` are kept as they are (the committed prefix).
        indices: long ``[n]`` (the same for every row) or ``[B, n]`` (one row of offsets per batch row): offsets
            into the positions from ``start`` on, each in ``[0, T - start)``; the kept entries are written in this
            order to positions ``start .. start + n - 1``.

    Raises:
        ValueError: ``indices`` not 1-D or ``[B, n]``, ``start`` outside the cache, or an index out of range.
        NotImplementedError: a layer cannot be compacted.
    """
    check_compactable(cache)
    total = cache_length(cache)
    if indices.ndim not in (1, 2):
        raise ValueError(f"indices must be long [n] or [B, n], got {tuple(indices.shape)}")
    if not 0 <= start <= total:
        raise ValueError(f"start must be in [0, {total}] (the cache length), got {start}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= total - start):
        raise ValueError(f"indices must lie in [0, {total - start}) (positions after start), got {indices.tolist()}")
    for layer in cache.layers:
        if layer.is_initialized and indices.ndim == 2 and indices.shape[0] != layer.keys.shape[0]:
            raise ValueError(f"indices has {indices.shape[0]} rows but the cache batch is {layer.keys.shape[0]}")
    compact(cache, start, indices)


def compact(cache: DynamicCache, start: int, indices: Tensor) -> None:
    """:func:`keep_positions` without its checks, for a decoder's inner loop (inputs from its own tree buffers, the
    cache checked once per request with :func:`check_compactable`)."""
    n = indices.shape[-1]
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        source = (start + indices).to(layer.keys.device)
        # Both selections copy before the slice assignment, so overlapping source and target ranges are safe.
        layer.keys[..., start:start + n, :] = _select(layer.keys, source)
        layer.values[..., start:start + n, :] = _select(layer.values, source)
        _truncate(layer, start + n)


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer, unchecked (:func:`compact` when the kept positions are
    already in place, e.g. a tree step that accepted the root only)."""
    for layer in cache.layers:
        if layer.is_initialized:
            _truncate(layer, length)


def _truncate(layer: DynamicLayer, length: int) -> None:
    if isinstance(layer, PreallocatedLayer):
        layer.truncate(length)
    else:
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def _select(states: Tensor, source: Tensor) -> Tensor:
    """``states [B, heads, T, head_dim]`` at ``source`` (``[n]`` or ``[B, n]``) -> ``[B, heads, n, head_dim]``."""
    if source.ndim == 1:
        return states.index_select(-2, source)
    b, h, _, d = states.shape
    return states.gather(2, source[:, None, :, None].expand(b, h, source.shape[1], d))


def keep_tree_nodes(cache: DynamicCache, past_length: int, accepted_nodes: Tensor) -> None:
    """After a tree pass: keep the prefix and the accepted nodes' entries, in path order (in place).

    Args:
        cache: holds ``past_length`` prefix positions followed by N tree-node positions.
        past_length: positions committed before the tree pass.
        accepted_nodes: long ``[A + 1]`` or ``[B, A + 1]``, node indices of the accepted path, root first.

    Raises:
        ValueError / NotImplementedError: as :func:`keep_positions`.
    """
    keep_positions(cache, past_length, accepted_nodes.to(torch.long))


def select_rows(cache: DynamicCache, rows: Tensor) -> None:
    """Keep only batch rows ``rows`` (long ``[B']``, in that order) of every layer (in place).

    Raises:
        NotImplementedError: a layer cannot be compacted.
    """
    check_compactable(cache)
    for layer in cache.layers:
        if layer.is_initialized:
            index = rows.to(layer.keys.device)
            if isinstance(layer, PreallocatedLayer):
                layer.batch_select_indices(index)
            else:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
