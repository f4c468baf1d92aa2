"""Dynamic draft trees (EAGLE-2, Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", arXiv:2406.16858, Sec. 4): the tree is grown anew at every step from the drafter's own confidence.

**Expansion**: the root's children are the drafter's top-``topk`` tokens; then, ``depth - 1`` times, the ``topk``
nodes of the newest level with the highest cumulative draft log-probability (the sum of the log-probabilities along
the path, the paper's value ``V_i``) are expanded, each into its own top-``topk`` tokens. **Reranking**: of every
drafted node (``topk + (depth - 1) * topk**2``), the ``total`` with the highest cumulative log-probability are kept,
ties going to the shallower node. A child's value never exceeds its parent's, so the kept nodes form a prefix-closed
tree; it is verified in the one tree pass as a static tree is.

The kept tree is written as rank paths (node ``[i_0, i_1]``: the rank-``i_1`` token drafted from node ``[i_0]``),
so the step's :class:`~medusa_train.tree.buffers.TreeBuffers` come from
:func:`medusa_train.tree.buffers.build_tree_buffers` (cached by shape: a tree that recurs costs nothing to build).
With several batch rows the rows share one tree shape (the rank paths whose values summed over the rows are highest),
each row with its own tokens; with one row it is EAGLE-2's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from medusa_train.tree.buffers import Path, TreeBuffers, build_tree_buffers


@dataclass(frozen=True)
class DynamicTree:
    """The shape of a dynamic tree (see the module docstring).

    Attributes:
        depth: D, the deepest node's depth (drafter calls per step: the committed positions' pass plus D - 1).
        topk: nodes expanded per level and tokens drafted per expanded node.
        total: drafted nodes kept (the root not counted): the tree pass verifies ``total + 1`` tokens.

    Raises:
        ValueError: a field that is not a positive int, or ``total`` above the drafted nodes
            ``topk + (depth - 1) * topk**2`` (the message names ``dynamic_tree.<field>``).
    """

    depth: int
    topk: int
    total: int

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dynamic_tree.{name} must be a positive int, got {value!r}")
        if self.total > self.drafted:
            raise ValueError(f"dynamic_tree.total={self.total} exceeds the {self.drafted} nodes a tree of depth "
                             f"{self.depth} and topk {self.topk} drafts (topk + (depth - 1) * topk**2); lower total "
                             "or raise depth/topk")

    @property
    def drafted(self) -> int:
        """Nodes drafted before reranking: ``topk + (depth - 1) * topk**2``."""
        return self.topk + (self.depth - 1) * self.topk ** 2

    @property
    def num_nodes(self) -> int:
        """N, the verified tree's nodes, the root included (``total + 1``)."""
        return self.total + 1

    @property
    def max_depth(self) -> int:
        """D (``depth``): a bound on the kept tree's depth."""
        return self.depth

    def as_dict(self) -> dict[str, int]:
        return {"depth": self.depth, "topk": self.topk, "total": self.total}


def dynamic_tree(value: DynamicTree | dict | tuple | list | None) -> DynamicTree | None:
    """A :class:`DynamicTree` from itself, ``{"depth", "topk", "total"}`` or ``(depth, topk, total)``; None stays None.

    Raises:
        ValueError: another form, or invalid fields (as :class:`DynamicTree`).
    """
    if value is None or isinstance(value, DynamicTree):
        return value
    if isinstance(value, dict) or hasattr(value, "keys"):
        keys = set(value.keys())
        if keys != {"depth", "topk", "total"}:
            raise ValueError(f"dynamic_tree must have the keys depth, topk and total, got {sorted(keys)}")
        return DynamicTree(**{k: value[k] for k in keys})
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 3:
        return DynamicTree(*value)
    raise ValueError(f"dynamic_tree must be (depth, topk, total) or a mapping of them, got {value!r}")


@functools.lru_cache(maxsize=512)
def _buffers(paths: tuple[Path, ...], device: str) -> TreeBuffers:
    depth = max(len(p) for p in paths)
    return build_tree_buffers([list(p) for p in paths], depth, 1 + max(max(p) for p in paths), device=device)


def tree_of_paths(paths: tuple[Path, ...], device: str | torch.device) -> TreeBuffers:
    """The :class:`TreeBuffers` of a non-empty, prefix-closed set of rank paths (built once per distinct set and
    device; validated against their own depth and largest rank: ``num_heads`` and ``topk`` of the buffers).

    Raises:
        ValueError: an empty or not prefix-closed set (:func:`medusa_train.tree.buffers.validate_medusa_choices`).
    """
    if not paths:
        raise ValueError("tree_of_paths: a tree needs at least one node below the root")
    return _buffers(tuple(sorted(paths, key=lambda p: (len(p), p))), str(device))


__all__ = ["DynamicTree", "dynamic_tree", "tree_of_paths"]
