"""Medusa's tree drafter: every head reads the hidden state of the last committed position, so the K heads run in one
batched call and node ``[i_0, ..., i_d]`` holds head d's rank-``i_d`` token (Medusa's ``generate_candidates``; Cai et
al. 2024, Sec. 2.1.2). The protocol: :class:`medusa_train.models.tree_drafter.TreeDrafter`.

Shapes: B batch, D tree depth, N tree nodes, V' the heads' vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from medusa_train.tree.buffers import TreeBuffers, gather_node_tokens
from medusa_train.models.tree_drafter import LastFeatureDrafter


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


__all__ = ["MedusaTreeDrafter"]
