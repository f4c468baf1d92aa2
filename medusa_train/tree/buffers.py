"""Medusa candidate trees: validation of ``medusa_choices`` and the tensors tree attention needs.

A tree is given as ``medusa_choices``, a list of paths. Path ``[i, j]`` means "head 0's rank-``i`` token, then
head 1's rank-``j`` token": a node at depth ``d`` holds a token proposed by head ``d - 1``. Node 0, the root, is
the base model's own next token; the tree must be prefix-closed (every prefix of a path is itself a path).

The buffers follow the semantics of Medusa's ``generate_medusa_buffers`` (FasterDecoding/Medusa,
``medusa/model/utils.py`` at 10a2697; Cai et al. 2024, "Medusa", Sec. 2.1.2 "Tree Attention"): nodes sorted by
(depth, path), a mask letting each node see its ancestors and itself, positions equal to depths, and one row of
node indices per root-to-leaf path. Differences: the mask is ``bool``, leaves in ``retrieve_indices`` are in
lexicographic path order (rank-0 paths first) rather than Medusa's reverse order, and ``parents``/``children``
are added for rejection sampling over the tree.

Shapes use N tree nodes, P root-to-leaf paths, D the tree depth, K heads, B batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

Path = tuple[int, ...]

TOPK = 10  # candidates per head: Medusa's default, and the ranks its trees (mc_sim_7b_63: ranks 0-9) are built from

# Medusa's mc_sim_7b_63 tree (FasterDecoding/Medusa, medusa/model/medusa_choices.py at 11af0aa), tuned for
# Vicuna-7B heads with topk=10: 63 paths, 64 nodes, depth 4. The list is in the order the greedy tree search
# added nodes (estimated acceptance, best first), so every prefix of it is itself prefix-closed.
MC_SIM_7B_63: tuple[Path, ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)


def default_medusa_choices(num_heads: int, topk: int) -> list[list[int]]:
    """Medusa's ``mc_sim_7b_63`` tree cut to ``num_heads`` levels and ranks below ``topk`` (still prefix-closed)."""
    return [list(p) for p in MC_SIM_7B_63 if len(p) <= num_heads and max(p) < topk]


# A small tree for CPU verification: the first 15 paths of MC_SIM_7B_63 (16 nodes, depth 3, ranks < 6). On a
# 2-thread CPU a 16-token forward pass of a ~100M-500M Llama costs about 1.0-1.8x a 1-token one.
SMALL_TREE_15: tuple[Path, ...] = MC_SIM_7B_63[:15]


def chain_choices(depth: int) -> list[list[int]]:
    """The chain tree ``[[0], [0, 0], ...]`` of ``depth`` paths (each head's top-1 token).

    Raises:
        ValueError: ``depth`` is not a positive int.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"chain_choices: depth must be a positive int, got {depth!r}")
    return [[0] * d for d in range(1, depth + 1)]


def validate_medusa_choices(
    medusa_choices: Sequence[Sequence[int]], num_heads: int, topk: int
) -> list[Path]:
    """Check a tree spec and return its paths sorted by (depth, path).

    Args:
        medusa_choices: paths, each a non-empty sequence of ranks (non-negative ints).
        num_heads: number of Medusa heads K; no path may be deeper.
        topk: candidates taken from each head; every rank must be < topk.

    Returns:
        The paths as tuples, sorted by (depth, path); node ``i > 0`` of the tree is entry ``i - 1``.

    Raises:
        ValueError: ``num_heads`` or ``topk`` < 1; the list is empty; a path is empty or not a sequence of ints;
            a rank is negative or >= topk; a path is deeper than num_heads; a path's prefix is missing; a path
            is repeated. The message names the offending path and its index in ``medusa_choices``.
    """
    for name, value in (("num_heads", num_heads), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(medusa_choices, (str, bytes)) or not isinstance(medusa_choices, Sequence):
        raise ValueError(f"medusa_choices must be a list of paths, got {type(medusa_choices).__name__}")
    if len(medusa_choices) == 0:
        raise ValueError("medusa_choices is empty: give at least one path, e.g. [[0]]")

    first_index: dict[Path, int] = {}
    for index, raw in enumerate(medusa_choices):
        where = f"medusa_choices[{index}] = {raw!r}"
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise ValueError(f"{where}: a path must be a list of ranks")
        if len(raw) == 0:
            raise ValueError(f"{where}: a path must not be empty (the root is implicit)")
        for rank in raw:
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise ValueError(f"{where}: ranks must be ints, got {rank!r}")
            if rank < 0 or rank >= topk:
                raise ValueError(f"{where}: rank {rank} is outside [0, topk={topk}); raise topk or drop the path")
        if len(raw) > num_heads:
            raise ValueError(
                f"{where}: depth {len(raw)} exceeds num_heads={num_heads}; shorten the path or add heads"
            )
        path = tuple(raw)
        if path in first_index:
            raise ValueError(f"{where}: duplicate of medusa_choices[{first_index[path]}]; remove one")
        first_index[path] = index

    for path, index in first_index.items():
        if len(path) > 1 and path[:-1] not in first_index:
            raise ValueError(
                f"medusa_choices[{index}] = {list(path)}: its prefix {list(path[:-1])} is missing; "
                "the tree must be prefix-closed"
            )
    return sorted(first_index, key=lambda p: (len(p), p))


@dataclass(frozen=True, eq=False)
class TreeBuffers:
    """Tensors describing one candidate tree, built once by :func:`build_tree_buffers` and passed to decoders.

    Attributes:
        paths: node ``i > 0`` is ``paths[i - 1]``; sorted by (depth, path).
        num_heads: K, heads the tree was validated against.
        topk: candidates per head the tree was validated against.
        attn_mask: bool [N, N]; ``attn_mask[i, j]`` is True iff node j is node i or an ancestor of it.
        tree_indices: long [N]; index of each node's token in the flat candidate vector
            ``cat([root_token], head0_topk, head1_topk, ...)`` of length ``1 + K * topk``.
        position_ids: long [N]; depth of each node (root 0), to add to the current sequence length.
        parents: long [N]; parent node index, -1 for the root.
        children: long [N, C]; child node indices in rank order, padded with -1 (C = most children of a node).
        retrieve_indices: long [P, D + 1]; row p lists the nodes on root-to-leaf path p (root first),
            padded with -1. Rows are in lexicographic order of the leaves' paths.
    """

    paths: tuple[Path, ...]
    num_heads: int
    topk: int
    attn_mask: Tensor
    tree_indices: Tensor
    position_ids: Tensor
    parents: Tensor
    children: Tensor
    retrieve_indices: Tensor

    @property
    def num_nodes(self) -> int:
        """N, the root included."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        """D, the depth of the deepest node (the root has depth 0)."""
        return self.retrieve_indices.shape[1] - 1

    @property
    def num_paths(self) -> int:
        """P, the number of root-to-leaf paths (leaves)."""
        return self.retrieve_indices.shape[0]

    @property
    def max_children(self) -> int:
        """C, the largest number of children of one node."""
        return self.children.shape[1]

    @property
    def depths(self) -> Tensor:
        """long [N]: depth of each node; the same tensor as ``position_ids``."""
        return self.position_ids

    @property
    def retrieve_valid(self) -> Tensor:
        """bool [P, D + 1]: True where ``retrieve_indices`` holds a node (not padding)."""
        return self.retrieve_indices >= 0

    def to(self, device: torch.device | str) -> TreeBuffers:
        """A copy with every tensor on ``device``."""
        tensors = ("attn_mask", "tree_indices", "position_ids", "parents", "children", "retrieve_indices")
        return replace(self, **{name: getattr(self, name).to(device) for name in tensors})


def build_tree_buffers(
    medusa_choices: Sequence[Sequence[int]],
    num_heads: int,
    topk: int,
    device: torch.device | str | None = None,
) -> TreeBuffers:
    """Validate ``medusa_choices`` and build its :class:`TreeBuffers` (Medusa, Cai et al. 2024, Sec. 2.1.2).

    Args:
        medusa_choices: prefix-closed list of paths (see :func:`validate_medusa_choices`).
        num_heads: K, the number of Medusa heads.
        topk: candidates taken from each head.
        device: where to put the tensors (default CPU).

    Raises:
        ValueError: as :func:`validate_medusa_choices`.
    """
    paths = validate_medusa_choices(medusa_choices, num_heads, topk)
    node_of: dict[Path, int] = {(): 0}
    for i, path in enumerate(paths, start=1):
        node_of[path] = i
    n = len(paths) + 1

    parents = [-1] + [node_of[p[:-1]] for p in paths]
    depths = [0] + [len(p) for p in paths]
    tree_indices = [0] + [1 + (len(p) - 1) * topk + p[-1] for p in paths]

    attn_mask = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        ancestor = node
        while ancestor >= 0:
            attn_mask[node, ancestor] = True
            ancestor = parents[ancestor]

    # Nodes are sorted by (depth, path), so siblings are appended in rank order.
    child_lists: list[list[int]] = [[] for _ in range(n)]
    for node in range(1, n):
        child_lists[parents[node]].append(node)
    width = max(len(c) for c in child_lists)
    children = torch.full((n, width), -1, dtype=torch.long)
    for node, kids in enumerate(child_lists):
        children[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)

    leaves = sorted((p for p in paths if not child_lists[node_of[p]]))
    max_depth = max(depths)
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        retrieve[row, : len(leaf) + 1] = torch.tensor([node_of[leaf[:d]] for d in range(len(leaf) + 1)])

    buffers = TreeBuffers(
        paths=tuple(paths),
        num_heads=num_heads,
        topk=topk,
        attn_mask=attn_mask,
        tree_indices=torch.tensor(tree_indices, dtype=torch.long),
        position_ids=torch.tensor(depths, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        children=children,
        retrieve_indices=retrieve,
    )
    return buffers if device is None else buffers.to(device)


def gather_node_tokens(flat_candidates: Tensor, tree: TreeBuffers) -> Tensor:
    """Pick each node's token from the flat candidate vector (Medusa's ``generate_candidates``).

    Args:
        flat_candidates: long [B, 1 + K * topk], ``cat([root_token], head0_topk, head1_topk, ...)`` per row,
            with K = ``tree.num_heads`` and topk = ``tree.topk``.

    Returns:
        long [B, N], the token of every tree node.

    Raises:
        ValueError: ``flat_candidates`` is not 2-D of that width.
    """
    width = 1 + tree.num_heads * tree.topk
    if flat_candidates.ndim != 2 or flat_candidates.shape[1] != width:
        raise ValueError(
            f"flat_candidates must have shape [B, 1 + num_heads * topk] = [B, {width}], "
            f"got {tuple(flat_candidates.shape)}"
        )
    return flat_candidates[:, tree.tree_indices]


def gather_paths(node_values: Tensor, tree: TreeBuffers) -> Tensor:
    """Lay per-node values out along root-to-leaf paths (Medusa's ``cart_candidates`` and path logits).

    Args:
        node_values: [B, N, ...] (tokens [B, N] or logits [B, N, V]).

    Returns:
        [B, P, D + 1, ...]; padding positions (``~tree.retrieve_valid``) repeat the root's value.

    Raises:
        ValueError: dimension 1 of ``node_values`` is not N.
    """
    if node_values.ndim < 2 or node_values.shape[1] != tree.num_nodes:
        raise ValueError(
            f"node_values must have shape [B, N={tree.num_nodes}, ...], got {tuple(node_values.shape)}"
        )
    return node_values[:, tree.retrieve_indices.clamp(min=0)]
