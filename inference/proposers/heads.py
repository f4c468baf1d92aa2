"""Tree drafters: draft heads fill every node of a candidate tree, which one target pass then verifies.

:class:`TreeDrafter` is the candidate step of :func:`inference.decoders.medusa.medusa_step` (Medusa paper, Sec.
2.1.2: the tree's node tokens are the heads' top-k candidates). It has one method, and two implementations that share
no code:

- :class:`MedusaTreeDrafter`: every head reads the hidden state of the last committed position, so the K heads run in
  one batched call and node ``[i_0, ..., i_d]`` holds head d's rank-``i_d`` token (Medusa's ``generate_candidates``).
- :class:`HydraTreeDrafter`: head d also reads the tokens on the node's path (Hydra, Ankner et al. 2024,
  arXiv:2402.05109, Sec. 3), so the tree is filled level by level: one batched call of head d over every depth-d
  node that has children, whose top-k are those children's tokens. Drafting costs D sequential head calls (D the
  tree's depth) where Medusa's costs one, and grows with the number of expanded nodes: decoders report it apart
  (``DecodeResult.draft_time_s``).

Both are deterministic functions of the committed sequence and the root, so speculative sampling may treat each
drafted token as a point mass (see :mod:`inference.decoders.medusa`).

Shapes: B batch, K heads, N tree nodes, D tree depth, H hidden, V' the heads' vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from inference.tree import TreeBuffers, gather_node_tokens
from medusa_train.drafters.catalog import type_of


@runtime_checkable
class TreeDrafter(Protocol):
    """Fills a candidate tree for each batch row."""

    def draft(self, hidden: Tensor, root: Tensor, tree: TreeBuffers) -> Tensor:
        """The token of every tree node.

        Args:
            hidden: ``[B, H]``, the base's last hidden state at each row's last committed position t.
            root: long ``[B]``, each row's token at t+1 (emitted, not yet verified by a pass): node 0.
            tree: the tree buffers (on the model's device).

        Returns:
            long ``[B, N]`` base-vocabulary ids, ``[:, 0] == root``.
        """
        ...


class MedusaTreeDrafter:
    """Medusa heads: ``model.head_logits(hidden, num_heads=D)`` ``[D, B, V']`` (only the D heads a tree of depth D
    reads, ``tree.num_heads``), each head's top-k laid out by ``tree_indices``."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def draft(self, hidden: Tensor, root: Tensor, tree: TreeBuffers) -> Tensor:
        batch = hidden.shape[0]
        head_logits = self.model.head_logits(hidden, num_heads=tree.num_heads)  # [D, B, V']
        drafts = self.model.heads.to_base_tokens(head_logits.topk(tree.topk, dim=-1).indices)  # [D, B, topk]
        flat = torch.cat([root[:, None], drafts.permute(1, 0, 2).reshape(batch, -1)], dim=1)  # [B, 1 + D * topk]
        return gather_node_tokens(flat, tree)


@dataclass(frozen=True)
class _Level:
    """One depth d of the tree, for :class:`HydraTreeDrafter`.

    Attributes:
        depth: d (head d runs at this level).
        paths: long ``[P, d + 1]``, the nodes root .. node of each of the P depth-d nodes that have children.
        children: long ``[C]``, the depth-(d + 1) nodes.
        parent: long ``[C]``, each child's parent as an index into ``paths``' rows.
        rank: long ``[C]``, each child's rank among its parent's candidates.
        width: ranks to take from head d (the largest child rank + 1).
    """

    depth: int
    paths: Tensor
    children: Tensor
    parent: Tensor
    rank: Tensor
    width: int


def hydra_levels(tree: TreeBuffers) -> list[_Level]:
    """The tree cut into levels: for each depth d < D, the nodes head d expands and the children it fills."""
    parents = tree.parents.tolist()
    depths = tree.position_ids.tolist()
    levels = []
    for d in range(tree.max_depth):
        children = [n for n in range(1, tree.num_nodes) if depths[n] == d + 1]
        expanded = sorted({parents[c] for c in children})
        row = {node: i for i, node in enumerate(expanded)}
        paths = []
        for node in expanded:
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            paths.append(path[::-1])  # root .. node, d + 1 nodes
        ranks = [tree.paths[c - 1][-1] for c in children]
        device = tree.parents.device
        levels.append(_Level(depth=d, paths=torch.tensor(paths, dtype=torch.long, device=device),
                             children=torch.tensor(children, dtype=torch.long, device=device),
                             parent=torch.tensor([row[parents[c]] for c in children], dtype=torch.long, device=device),
                             rank=torch.tensor(ranks, dtype=torch.long, device=device), width=max(ranks) + 1))
    return levels


class HydraTreeDrafter:
    """Hydra heads, level by level (see the module docstring): ``model.head_logits_at(d, hidden, path_tokens)``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._tree: TreeBuffers | None = None
        self._levels: list[_Level] = []

    def levels(self, tree: TreeBuffers) -> list[_Level]:
        """The tree's levels, computed once per tree."""
        if self._tree is not tree:
            self._tree, self._levels = tree, hydra_levels(tree)
        return self._levels

    def draft(self, hidden: Tensor, root: Tensor, tree: TreeBuffers) -> Tensor:
        batch, size = hidden.shape
        tokens = root.new_zeros(batch, tree.num_nodes)
        tokens[:, 0] = root
        for level in self.levels(tree):
            path_tokens = tokens[:, level.paths]  # [B, P, d + 1], filled by the levels above
            rows = hidden[:, None, :].expand(batch, level.paths.shape[0], size)  # [B, P, H]
            logits = self.model.head_logits_at(level.depth, rows, path_tokens)  # [B, P, V']
            top = logits.topk(level.width, dim=-1).indices  # [B, P, width]
            tokens[:, level.children] = self.model.heads.to_base_tokens(top[:, level.parent, level.rank])
        return tokens


def tree_drafter(model: Any) -> TreeDrafter:
    """The tree drafter of ``model``'s heads: the one their type declares in the drafter catalog
    (:meth:`medusa_train.drafters.catalog.DrafterType.make_tree_drafter`).

    Raises:
        ValueError: a type without a tree drafter.
    """
    return type_of(model.heads).make_tree_drafter(model)


__all__ = ["HydraTreeDrafter", "MedusaTreeDrafter", "TreeDrafter", "hydra_levels", "tree_drafter"]
