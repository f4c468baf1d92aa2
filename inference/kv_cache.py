"""KV-cache surgery for tree verification on transformers 5 ``DynamicCache``.

After a tree pass the cache holds the prompt-and-reply prefix (``past`` positions) followed by one entry per tree
node; only the nodes on the accepted path belong to the sequence. :func:`keep_tree_nodes` moves the accepted
nodes' keys and values to directly follow the prefix and drops the rest, so the next pass sees one contiguous
sequence (Medusa's ``update_inference_inputs``, FasterDecoding/Medusa ``medusa/model/utils.py`` at 10a2697, which
copies into a preallocated buffer; here the cache is transformers' own object and its tensors are reassigned).

Each layer in ``cache.layers`` holds ``keys``/``values`` of shape ``[B, heads, T, head_dim]``. Only full-attention
``DynamicLayer`` layers can be compacted: a sliding-window layer drops old entries by itself and a quantized or
offloaded layer keeps a second copy elsewhere, so those raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def check_compactable(cache: DynamicCache) -> None:
    """Raise ``NotImplementedError`` unless every layer of ``cache`` is a plain full-attention ``DynamicLayer``."""
    if not isinstance(cache, DynamicCache):
        raise NotImplementedError(f"KV compaction needs a transformers DynamicCache, got {type(cache).__name__}")
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"cache layer {i} is a {type(layer).__name__}; KV compaction supports full-attention DynamicLayer "
                "only (no sliding-window, quantized or offloaded layers)"
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
    n = indices.shape[-1]
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if indices.ndim == 2 and indices.shape[0] != layer.keys.shape[0]:
            raise ValueError(f"indices has {indices.shape[0]} rows but the cache batch is {layer.keys.shape[0]}")
        source = (start + indices).to(layer.keys.device)
        # Both selections copy before the slice assignment, so overlapping source and target ranges are safe.
        layer.keys[..., start:start + n, :] = _select(layer.keys, source)
        layer.values[..., start:start + n, :] = _select(layer.values, source)
        layer.keys = layer.keys[..., : start + n, :]
        layer.values = layer.values[..., : start + n, :]


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
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
