"""Hydra's tree drafter: head d also reads the tokens on the node's path (Hydra, Ankner et al. 2024, arXiv:2402.05109,
Sec. 3), so the tree is filled level by level (:func:`medusa_train.models.tree_drafter.tree_levels`): one batched call of
head d over every depth-d node that has children, whose top-k are those children's tokens. Drafting costs D
sequential head calls (D the tree's depth) where Medusa's costs one, and grows with the number of expanded nodes:
decoders report it apart (``DecodeResult.draft_time_s``). The protocol: :class:`medusa_train.models.tree_drafter.TreeDrafter`.

Shapes: B batch, P expanded nodes of a level, N tree nodes, H hidden, V' the heads' vocabulary.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from medusa_train.tree.buffers import TreeBuffers
from medusa_train.models.tree_drafter import LastFeatureDrafter, TreeLevel, tree_levels


class HydraTreeDrafter(LastFeatureDrafter):
    """Hydra heads, level by level (see the module docstring): ``model.head_logits_at(d, hidden, path_tokens)``,
    ``hidden`` the last committed position's ``FINAL`` feature."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self._tree: TreeBuffers | None = None
        self._levels: list[TreeLevel] = []

    def levels(self, tree: TreeBuffers) -> list[TreeLevel]:
        """The tree's levels, computed once per tree."""
        if self._tree is not tree:
            self._tree, self._levels = tree, tree_levels(tree)
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


__all__ = ["HydraTreeDrafter"]
