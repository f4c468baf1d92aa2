"""Tree drafters: a drafter fills every node of a candidate tree, which one target pass then verifies.

:class:`TreeDrafter` is the per-request protocol of the tree decoder (:class:`inference.decoders.medusa.TreeDecoder`,
one step :func:`inference.decoders.medusa.tree_step`; Medusa paper, Sec. 2.1.2: the tree's node tokens are the
drafter's candidates). The decoder calls, per request:

1. :meth:`~TreeDrafter.start` once, after the prefill, with the prompt's target features;
2. then per step :meth:`~TreeDrafter.draft` (the tree's tokens) and, after verification,
   :meth:`~TreeDrafter.accept` (the accepted path's tokens and target features), alternately;
3. :meth:`~TreeDrafter.select` whenever finished rows leave the batch (between an accept and the next draft).

So a drafter may keep per-request state (an autoregressive drafter: its own KV cache and the target features of
every committed token); the decoder keeps none for it. Two stateless implementations share that state (the FINAL
feature of each row's last committed position, :class:`LastFeatureDrafter`) and nothing else:

- :class:`MedusaTreeDrafter`: every head reads the hidden state of the last committed position, so the K heads run in
  one batched call and node ``[i_0, ..., i_d]`` holds head d's rank-``i_d`` token (Medusa's ``generate_candidates``).
- :class:`HydraTreeDrafter`: head d also reads the tokens on the node's path (Hydra, Ankner et al. 2024,
  arXiv:2402.05109, Sec. 3), so the tree is filled level by level: one batched call of head d over every depth-d
  node that has children, whose top-k are those children's tokens. Drafting costs D sequential head calls (D the
  tree's depth) where Medusa's costs one, and grows with the number of expanded nodes: decoders report it apart
  (``DecodeResult.draft_time_s``).

An autoregressive drafter with a KV cache of its own, :class:`inference.proposers.eagle3_drafter.Eagle3TreeDrafter`
(EAGLE-3), also grows EAGLE-2 dynamic trees (:class:`DynamicTreeDrafter`, :mod:`medusa_train.tree.dynamic`).

Both are deterministic functions of the committed sequence and the root, so speculative sampling may treat each
drafted token as a point mass (see :mod:`inference.decoders.medusa`).

**Target features** are named (``{FINAL: [B, T, H], ...}``); :meth:`medusa_train.model.MedusaModel.features` is
the one place the decoder turns a backbone pass into them.

Shapes: B batch, T prompt length (left-padded), K heads, N tree nodes, D tree depth, W accepted-path width (the
longest row's committed positions in a step), H hidden, V' the heads' vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from medusa_train.drafters.catalog import type_of
from medusa_train.features import FINAL
from medusa_train.tree.buffers import TreeBuffers, gather_node_tokens

@runtime_checkable
class TreeDrafter(Protocol):
    """Fills a candidate tree for each batch row of one request, keeping whatever per-request state it needs.

    Every tensor is on the model's device; features are in the model's dtype.
    """

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        """A new request, after the prefill (resets any state of an earlier request).

        Args:
            features: the target features of the prompt positions, ``{name: [B, T, H]}`` (``FINAL`` at least).
            tokens: long ``[B, T]``, the prompts, left-padded (the last column is every row's last prompt token).
            valid: bool ``[B, T]``, False at padding.
        """
        ...

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        """The token of every tree node, from the drafter's state (the committed sequence so far).

        Args:
            root: long ``[B]``, each row's token after its last committed position (emitted, not yet verified by a
                pass, not yet given to :meth:`accept`): node 0.
            tree: the tree buffers.

        Returns:
            long ``[B, N]`` base-vocabulary ids, ``[:, 0] == root``.
        """
        ...

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        """The positions one step committed: each row's accepted path, root first.

        Column i of ``tokens`` and of every feature is the same position (the same slot of the target's cache).
        The recovered-or-bonus token that follows the path is the next :meth:`draft`'s ``root``.

        Args:
            tokens: long ``[B, W]``, row b's root then its accepted drafted tokens in ``[:length[b]]``, -1 after.
            features: the tree pass's target features at those nodes, ``{name: [B, W, H]}``; after ``length[b]``
                the row repeats its last accepted node's features.
            length: long ``[B]``, each row's committed positions, 1 (the root alone) to D + 1; ``W == max(length)``.
        """
        ...

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (long ``[B']``, increasing batch indices), in that order: finished rows left."""
        ...


@runtime_checkable
class DynamicTreeDrafter(TreeDrafter, Protocol):
    """A :class:`TreeDrafter` that can also grow its own tree every step (an EAGLE-2 dynamic tree,
    :mod:`medusa_train.tree.dynamic`): the tree decoder calls :meth:`draft_dynamic` in place of :meth:`draft` when it
    is given ``dynamic_tree``, then verifies the returned tree (its mask, positions and paths) in the one pass."""

    def draft_dynamic(self, root: Tensor, shape: Any) -> tuple[Tensor, TreeBuffers]:
        """This step's tree and the token of every node.

        Args:
            root: as :meth:`TreeDrafter.draft`.
            shape: the :class:`~medusa_train.tree.dynamic.DynamicTree` (depth, topk, total).

        Returns:
            ``(tokens long [B, N], tree)``: base-vocabulary ids with ``[:, 0] == root``, and the step's buffers
            (N = ``tree.num_nodes`` <= ``shape.total + 1``, depth <= ``shape.depth``), shared by the batch rows.
        """
        ...


class LastFeatureDrafter:
    """The state of a drafter that reads one position: ``self.last``, ``[B, H]``, the ``FINAL`` feature of each
    row's last committed position (None before :meth:`start`)."""

    def __init__(self) -> None:
        self.last: Tensor | None = None

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        self.last = features[FINAL][:, -1]

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        final = features[FINAL]
        self.last = final[torch.arange(final.shape[0], device=final.device), length - 1]

    def select(self, keep: Tensor) -> None:
        self.last = self.last[keep]

    def state(self) -> Tensor:
        """``self.last``.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self.last is None:
            raise RuntimeError(f"{type(self).__name__}.draft() before start(): the decoder starts every request")
        return self.last


class MedusaTreeDrafter(LastFeatureDrafter):
    """Medusa heads: ``model.head_logits(hidden, num_heads=D)`` ``[D, B, V']`` (only the D heads a tree of depth D
    reads, ``tree.num_heads``) on the last committed position's ``FINAL`` feature, each head's top-k laid out by
    ``tree_indices``."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        hidden = self.state()
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


class HydraTreeDrafter(LastFeatureDrafter):
    """Hydra heads, level by level (see the module docstring): ``model.head_logits_at(d, hidden, path_tokens)``,
    ``hidden`` the last committed position's ``FINAL`` feature."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self._tree: TreeBuffers | None = None
        self._levels: list[_Level] = []

    def levels(self, tree: TreeBuffers) -> list[_Level]:
        """The tree's levels, computed once per tree."""
        if self._tree is not tree:
            self._tree, self._levels = tree, hydra_levels(tree)
        return self._levels

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        hidden = self.state()
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
    """A new drafter for ``model``'s heads, before :meth:`~TreeDrafter.start`: the one their type declares in the
    drafter catalog (:meth:`medusa_train.drafters.catalog.DrafterType.make_tree_drafter`).

    Raises:
        ValueError: a type without a tree drafter.
    """
    return type_of(model.heads).make_tree_drafter(model)


def grows_dynamic_trees(model: Any) -> bool:
    """Whether ``model``'s tree drafter (:func:`tree_drafter`) also grows EAGLE-2 dynamic trees
    (:class:`DynamicTreeDrafter`): decided by the protocol, for any drafter type.

    Raises:
        ValueError: a type without a tree drafter.
    """
    return isinstance(tree_drafter(model), DynamicTreeDrafter)


__all__ = ["DynamicTreeDrafter", "HydraTreeDrafter", "LastFeatureDrafter", "MedusaTreeDrafter", "TreeDrafter",
           "grows_dynamic_trees", "hydra_levels", "tree_drafter"]
