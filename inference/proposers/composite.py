"""One candidate tree from two drafters: a tree drafter's candidates and prompt lookup's, verified in one pass.

A learned tree drafter (Medusa, Hydra or EAGLE-3 heads, :mod:`medusa_train.models.tree_drafter`) and prompt lookup
(:mod:`inference.proposers.prompt_lookup`) win different prompts: lookup where the reply copies the context
(translation, extraction, summarization), the heads where it does not. A tree pass over a few more tokens costs little
more than over fewer on a memory-bound target, so :class:`CompositeTreeDrafter` puts both proposals in one tree and
the verification keeps whichever path is longest (Medusa paper, Sec. 2.1.2: any token tree is verified exactly by tree
attention; the acceptance rules, :mod:`medusa_train.tree.acceptance`, hold for any deterministic candidate set).

**The merged tree**, per step and per row, is a trie of token sequences rooted at the root token, grown within a node
budget (:attr:`~medusa_train.tree.composite.CompositeTree.nodes`, the root not counted; the split's settings live
in :mod:`medusa_train.tree.composite`, below training and tuning):

1. the lookup drafts first: up to ``lookup_matches`` distinct continuations of at most ``lookup_length`` tokens
   (:meth:`~inference.proposers.prompt_lookup.NgramIndex.continuations`: transformers' prompt lookup rule over the
   prompt and the reply so far), each a chain from the root;
2. then the tree drafter's nodes, in the tree's priority order (the order of ``medusa_choices`` when each of its
   prefixes is a tree, as ``medusa-tune-tree`` writes it; else by depth), each below its parent's place in the trie,
   until the budget is spent.

A token already present under the same parent is not added twice (shared prefixes are merged: a lookup draft that
begins with the heads' top-1 token extends that node), so a merged node costs nothing; when the lookup finds no
match, the heads fill the whole budget. Node ``[i_0, i_1, ...]`` of the merged tree is the ``i_1``-th child added
below the ``i_0``-th child of the root (rank paths in insertion order), and its buffers come from
:func:`medusa_train.tree.dynamic.tree_of_paths`, so the step verifies it as a dynamic tree (the tree decoder's
``draft_dynamic`` path).

With several batch rows the rows share one tree shape: the union of the rows' rank paths, taken round-robin in each
row's insertion order until the budget is spent; a row's token at a node it did not grow is its root token (any
token keeps verification exact; this one is rarely accepted).

Shapes: B batch, N nodes of the merged tree (root included), N_h nodes of the drafter's tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.proposers.prompt_lookup import NgramIndex
from medusa_train.tree.buffers import Path, TreeBuffers
from medusa_train.tree.composite import MAX_MATCHING_NGRAM_SIZE, CompositeTree
from medusa_train.models.tree_drafter import TreeDrafter
from medusa_train.tree.dynamic import DynamicTree, tree_of_paths

@dataclass(frozen=True)
class CompositeShape:
    """What the tree decoder holds for a composite step: the budget split and the drafter's own tree.

    Attributes:
        composite: the budget split.
        heads: the drafter's tree: static buffers, or a dynamic tree's shape for drafters that grow one.
        order: the static tree's nodes (indices into ``heads``, root excluded) in priority order; () for a dynamic
            tree (node order).
    """

    composite: CompositeTree
    heads: TreeBuffers | DynamicTree
    order: tuple[int, ...] = ()

    @property
    def num_nodes(self) -> int:
        """N, at most: the root and the budget, or fewer when the drafter's nodes and the lookup drafts cannot fill
        it (the request's KV cache is sized by it: a budget far beyond them allocates nothing for it)."""
        split = self.composite
        return 1 + min(split.nodes, self.heads.num_nodes - 1 + split.lookup_length * split.lookup_matches)

    @property
    def max_depth(self) -> int:
        """A bound on the merged tree's depth: the drafter's tree's or a lookup draft's."""
        return max(self.heads.max_depth, self.composite.lookup_length)


def priority_order(medusa_choices: Sequence[Sequence[int]], tree: TreeBuffers) -> tuple[int, ...]:
    """``tree``'s nodes (root excluded) in the order of ``medusa_choices`` when every prefix of that list is itself
    prefix-closed (``medusa-tune-tree`` writes its trees best node first, so a prefix is the best smaller tree), else
    in node order (by depth: parents before children)."""
    node_of = {path: i for i, path in enumerate(tree.paths, start=1)}
    given = [tuple(p) for p in medusa_choices]
    seen: set[Path] = set()
    for path in given:
        if len(path) > 1 and path[:-1] not in seen:
            return tuple(range(1, tree.num_nodes))
        seen.add(path)
    return tuple(node_of[p] for p in given)


def merge(root: int, chains: Sequence[Sequence[int]], head_tokens: Sequence[int], head_parents: Sequence[int],
          order: Sequence[int], budget: int) -> tuple[list[Path], list[int]]:
    """One row's merged tree (see the module docstring): lookup chains first, then the drafter's nodes in ``order``.

    Args:
        root: the root token.
        chains: the lookup drafts, each a token list continuing the root.
        head_tokens: the drafter's token of each of its tree's nodes (``[0]`` the root).
        head_parents: each of those nodes' parent (``-1`` for the root).
        order: the drafter's nodes to add, parents before children.
        budget: the most nodes below the root.

    Returns:
        ``(paths, tokens)``: the merged tree's rank paths in insertion order (prefix-closed in every prefix) and the
        token of each (``tokens[i]`` is ``paths[i]``'s).
    """
    children: list[dict[int, int]] = [{}]  # per merged node: token -> merged node
    paths: list[Path] = [()]
    tokens: list[int] = [root]

    def child(node: int, token: int) -> int | None:
        kids = children[node]
        if token in kids:
            return kids[token]
        if len(paths) > budget:
            return None
        kids[token] = len(paths)
        paths.append(paths[node] + (len(kids) - 1,))
        tokens.append(token)
        children.append({})
        return kids[token]

    for chain in chains:
        node: int | None = 0
        for token in chain:
            node = child(node, token)
            if node is None:
                break
    place = {0: 0}  # drafter node -> merged node
    for head in order:
        parent = place.get(head_parents[head])
        if parent is not None:
            merged = child(parent, head_tokens[head])
            if merged is not None:
                place[head] = merged
    return paths[1:], tokens[1:]


class CompositeTreeDrafter:
    """A tree drafter whose every step's tree merges ``inner``'s candidates with prompt lookup's (see the module
    docstring); it grows a tree per step (``draft_dynamic``), which the tree decoder verifies as a dynamic tree.

    Args:
        inner: the model's tree drafter (:func:`~medusa_train.models.catalog.tree_drafter`); it is started,
            told every accepted path and every row selection, as the decoder would tell it.
        max_matching_ngram_size: the longest n-gram the lookup matches (``CompositeTree.max_matching_ngram_size``).
    """

    def __init__(self, inner: TreeDrafter, max_matching_ngram_size: int = MAX_MATCHING_NGRAM_SIZE) -> None:
        self.inner = inner
        self.max_ngram = max_matching_ngram_size
        self.rows: list[NgramIndex] = []  # per batch row: the prompt and the accepted tokens, indexed

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        self.inner.start(features, tokens, valid)
        self.rows = [NgramIndex(self.max_ngram, row[keep].tolist()) for row, keep in zip(tokens, valid)]

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        self.inner.accept(tokens, features, length)
        for index, row, n in zip(self.rows, tokens.tolist(), length.tolist()):
            index.extend(row[:n])

    def select(self, keep: Tensor) -> None:
        self.inner.select(keep)
        self.rows = [self.rows[i] for i in keep.tolist()]

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        raise TypeError("CompositeTreeDrafter grows its own tree every step: the tree decoder calls draft_dynamic "
                        "with a CompositeShape")

    def draft_dynamic(self, root: Tensor, shape: CompositeShape) -> tuple[Tensor, TreeBuffers]:
        """This step's merged tree and its tokens.

        Args:
            root: long ``[B]``, as :meth:`~medusa_train.models.tree_drafter.TreeDrafter.draft`.
            shape: the budget split and the drafter's tree.

        Returns:
            ``(tokens long [B, N], tree)``, ``[:, 0] == root``, N <= ``shape.num_nodes``.
        """
        split = shape.composite
        if isinstance(shape.heads, DynamicTree):
            head_tokens, heads = self.inner.draft_dynamic(root, shape.heads)
            order: Sequence[int] = range(1, heads.num_nodes)
        else:
            heads, order = shape.heads, shape.order
            head_tokens = self.inner.draft(root, heads)
        parents = heads.parents.tolist()
        roots = root.tolist()
        merged = [merge(r, index.continuations(r, split.lookup_length, split.lookup_matches), row, parents, order,
                        split.nodes)
                  for r, index, row in zip(roots, self.rows, head_tokens.tolist())]
        if len(merged) == 1:
            paths = merged[0][0]
            token_of = [dict(zip(*merged[0]))]
        else:
            paths = _union([p for p, _ in merged], split.nodes)
            token_of = [dict(zip(p, t)) for p, t in merged]
        tree = tree_of_paths(tuple(paths), root.device)
        tokens = [[r] + [row.get(p, r) for p in tree.paths] for r, row in zip(roots, token_of)]
        return torch.tensor(tokens, dtype=torch.long, device=root.device), tree


def _union(rows: Sequence[Sequence[Path]], budget: int) -> list[Path]:
    """The rows' rank paths taken round-robin, each row in its insertion order, until ``budget`` distinct paths."""
    union: dict[Path, None] = {}
    for i in range(max((len(r) for r in rows), default=0)):
        for row in rows:
            if i < len(row):
                union.setdefault(row[i], None)
                if len(union) == budget:
                    return list(union)
    return list(union)


__all__ = ["CompositeShape", "CompositeTreeDrafter", "merge", "priority_order"]
