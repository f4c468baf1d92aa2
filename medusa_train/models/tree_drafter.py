"""Tree drafters: a drafter fills every node of a candidate tree, which one target pass then verifies.

:class:`TreeDrafter` is the per-request protocol of the tree decoder (:class:`inference.decoders.tree.TreeDecoder`,
one step :func:`inference.decoders.tree.tree_step`; Medusa paper, Sec. 2.1.2: the tree's node tokens are the
drafter's candidates). The decoder calls, per request:

1. :meth:`~TreeDrafter.start` once, after the prefill, with the prompt's target features;
2. then per step :meth:`~TreeDrafter.draft` (the tree's tokens) and, after verification,
   :meth:`~TreeDrafter.accept` (the accepted path's tokens and target features), alternately;
3. :meth:`~TreeDrafter.select` whenever finished rows leave the batch (between an accept and the next draft).

So a drafter may keep per-request state (an autoregressive drafter: its own KV cache and the target features of
every committed token); the decoder keeps none for it. Each drafter type's folder holds its implementation, which its
catalog entry names (:attr:`medusa_train.models.catalog.DrafterType.tree_drafter`; :func:`medusa_train.models.catalog.tree_drafter`
builds it):

- Medusa heads (:class:`medusa_train.drafters.medusa.proposer.MedusaTreeDrafter`) and Hydra heads
  (:class:`medusa_train.drafters.hydra.proposer.HydraTreeDrafter`) keep one state, the FINAL feature of each row's
  last committed position (:class:`LastFeatureDrafter`); Hydra's fill the tree level by level (:func:`tree_levels`);
- EAGLE-3 drafters (:class:`medusa_train.drafters.eagle3.proposer.Eagle3TreeDrafter`) keep a KV cache of their own,
  also reading the tree level by level, and also grow EAGLE-2 dynamic trees (:class:`DynamicTreeDrafter`,
  :mod:`medusa_train.tree.dynamic`).

All are deterministic functions of the committed sequence and the root, so speculative sampling may treat each
drafted token as a point mass (see :mod:`inference.decoders.tree`).

**Target features** are named (``{FINAL: [B, T, H], ...}``); :meth:`medusa_train.models.speculative.SpeculativeModel.features` is
the one place the decoder turns a backbone pass into them.

Shapes: B batch, T prompt length (left-padded), K heads, N tree nodes, D tree depth, W accepted-path width (the
longest row's committed positions in a step), H hidden, V' the heads' vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from medusa_train.models.features import FINAL
from medusa_train.tree.buffers import TreeBuffers


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


@dataclass(frozen=True)
class TreeLevel:
    """One depth d of the tree, for drafters that fill it level by level (:func:`tree_levels`).

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


def tree_levels(tree: TreeBuffers) -> list[TreeLevel]:
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
        levels.append(TreeLevel(depth=d, paths=torch.tensor(paths, dtype=torch.long, device=device),
                                 children=torch.tensor(children, dtype=torch.long, device=device),
                                 parent=torch.tensor([row[parents[c]] for c in children], dtype=torch.long,
                                                     device=device),
                                 rank=torch.tensor(ranks, dtype=torch.long, device=device), width=max(ranks) + 1))
    return levels


__all__ = ["DynamicTreeDrafter", "LastFeatureDrafter", "TreeDrafter", "TreeLevel", "tree_levels"]
