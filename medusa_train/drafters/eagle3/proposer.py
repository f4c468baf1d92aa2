"""The EAGLE-3 tree drafter: an autoregressive drafter with a KV cache of its own, over a static or a dynamic tree.

The drafter (:class:`medusa_train.drafters.eagle3.drafter.Eagle3Drafter`) at position p reads the fused target
feature at p (``fuse`` of the features of its ``feature_layers``) and the target's input embedding of token p + 1, at
RoPE position p, and predicts token p + 2; at a drafted position it reads its own output feature (``out``) of the position
before instead of the target's. This is vLLM's EAGLE-3 proposer (``vllm/v1/spec_decode/llm_base_proposer.py``, vLLM
0.32: the first pass over the committed positions with the tokens shifted by one, then each step feeds the token
drafted at the step before with that step's ``out``), here over a tree.

Per request (:class:`~medusa_train.models.tree_drafter.TreeDrafter`):

- :meth:`~Eagle3TreeDrafter.start`: the prompt's positions wait ("pending") for the token after the last one (the
  root of the first step);
- :meth:`~Eagle3TreeDrafter.draft`: one drafter pass over the pending positions (tokens shifted by one, the root
  last) appends them to the drafter's cache; the last one's output drafts the root's children. Then level by level,
  each depth-d node that has children is a query at position ``c + d`` (c the last committed position) reading its
  parent's ``out`` and its own token's embedding, attending to the committed cache and its ancestors' drafted entries
  (an additive mask); its top-k are its children. The drafted entries are dropped afterwards (the cache is cut back
  to the committed positions);
- :meth:`~Eagle3TreeDrafter.accept`: the accepted path's positions become the pending ones;
- :meth:`~Eagle3TreeDrafter.draft_dynamic`: the same over an EAGLE-2 dynamic tree (:mod:`medusa_train.tree.dynamic`),
  returning the tree with its tokens.

Batch rows are left-padded at the start and right-padded after each accept: every row has its own positions, and the
cache slots of padding (and of rows that accepted fewer tokens) are masked. The drafts are a deterministic function
of the committed sequence and the root, so speculative sampling treats each as a point mass.

Shapes: B batch, W pending positions, L the drafter cache's slots, Q queries of one level, N tree nodes, H hidden,
V' the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from medusa_train.models.features import layer_feature
from medusa_train.tree.buffers import TreeBuffers
from medusa_train.models.tree_drafter import tree_levels
from medusa_train.tree.dynamic import DynamicTree, tree_of_paths
from medusa_train.tree.kv_cache import preallocated_cache, select_rows, truncate
from medusa_train.tree.masks import additive_mask, positions


@dataclass(frozen=True)
class _Pending:
    """Committed positions the drafter has not read yet (their next tokens were unknown).

    Attributes:
        hidden: ``[B, W, H]`` fused target features; tokens: long ``[B, W]`` (the token at each position);
        valid: bool ``[B, W]``; position: long ``[B, W]``; last: long ``[B]``, each row's last valid column.
    """

    hidden: Tensor
    tokens: Tensor
    valid: Tensor
    position: Tensor
    last: Tensor

    def select(self, keep: Tensor) -> _Pending:
        return _Pending(*(t[keep] for t in (self.hidden, self.tokens, self.valid, self.position, self.last)))


@dataclass(frozen=True)
class _Level:
    """Depth d >= 1 of a static tree: the depth-d nodes that have children (the queries), each query's parent as an
    index into the previous level's queries (0: the root), their children, and the mask of the queries over the
    drafted entries of the levels above and themselves (bool ``[Q, E + Q]``)."""

    depth: int
    nodes: Tensor
    parent: Tensor
    children: Tensor
    child_query: Tensor
    child_rank: Tensor
    width: int
    mask: Tensor


@dataclass(frozen=True)
class _Plan:
    root_children: Tensor
    root_rank: Tensor
    root_width: int
    levels: tuple[_Level, ...]


def static_plan(tree: TreeBuffers) -> _Plan:
    """How :meth:`Eagle3TreeDrafter.draft` fills ``tree``: the root's children, then one drafter call per depth."""
    cut = tree_levels(tree)
    levels: list[_Level] = []
    entries: list[int] = []  # drafted entries in the cache, in order (node indices)
    previous = [0]
    for level in cut[1:]:
        nodes = level.paths[:, -1].tolist()
        index = {node: i for i, node in enumerate(previous)}
        parent = [index[n] for n in level.paths[:, -2].tolist()]
        columns = torch.tensor(entries + nodes, dtype=torch.long, device=tree.attn_mask.device)
        node_index = torch.tensor(nodes, dtype=torch.long, device=tree.attn_mask.device)
        levels.append(_Level(depth=level.depth, nodes=node_index, parent=torch.tensor(parent, device=node_index.device),
                             children=level.children, child_query=level.parent, child_rank=level.rank,
                             width=level.width, mask=tree.attn_mask[node_index][:, columns]))
        entries += nodes
        previous = nodes
    root = cut[0]
    return _Plan(root_children=root.children, root_rank=root.rank, root_width=root.width, levels=tuple(levels))


class Eagle3TreeDrafter:
    """EAGLE-3 drafting over a tree (see the module docstring) for a :class:`~medusa_train.models.speculative.SpeculativeModel`
    holding an :class:`~medusa_train.drafters.eagle3.drafter.Eagle3Drafter` (``model.heads``; ``model.features``
    returns the taps its ``feature_layers`` name, ``model.embed`` the target's input embeddings)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.heads = model.heads
        self.taps = [layer_feature(i) for i in self.heads.spec.feature_layers]
        self.cache: Any = None
        self.cache_valid: Tensor | None = None  # bool [B, L], the committed slots of each row
        self.last: Tensor | None = None  # long [B], each row's last committed position
        self.pending: _Pending | None = None
        self._tree: TreeBuffers | None = None
        self._plan: _Plan | None = None

    # --- the protocol --------------------------------------------------------------------------------------------

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        batch, length = tokens.shape
        self.cache = preallocated_cache(2 * length + 64)  # grows by doubling as the reply lengthens
        self.cache_valid = valid.new_zeros(batch, 0)
        position = positions(valid)
        self.last = position[:, -1]
        self.pending = _Pending(self.fuse(features), tokens, valid, position,
                                torch.full((batch,), length - 1, dtype=torch.long, device=tokens.device))

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        width = tokens.shape[1]
        columns = torch.arange(width, device=tokens.device)
        self.pending = _Pending(self.fuse(features), tokens, columns[None, :] < length[:, None],
                                self.last[:, None] + 1 + columns[None, :], length - 1)
        self.last = self.last + length

    def select(self, keep: Tensor) -> None:
        select_rows(self.cache, keep)
        self.cache_valid, self.last = self.cache_valid[keep], self.last[keep]
        if self.pending is not None:
            self.pending = self.pending.select(keep)

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        """The tokens of ``tree``'s nodes (long ``[B, N]``, base ids, root first); see the module docstring."""
        out, logits = self._commit(root)
        plan = self.plan(tree)
        committed = self.cache_valid.shape[1]
        tokens = root.new_zeros(root.shape[0], tree.num_nodes)
        tokens[:, 0] = root
        top = logits.topk(plan.root_width, dim=-1).indices  # [B, width]
        tokens[:, plan.root_children] = self.heads.to_base_tokens(top[:, plan.root_rank])
        outs = out[:, None]  # [B, 1, H]: the previous level's outputs (the root's)
        for level in plan.levels:
            logits, outs = self._level(outs[:, level.parent], tokens[:, level.nodes], level.depth, level.mask)
            top = logits.topk(level.width, dim=-1).indices  # [B, Q, width]
            tokens[:, level.children] = self.heads.to_base_tokens(top[:, level.child_query, level.child_rank])
        truncate(self.cache, committed)
        return tokens

    def draft_dynamic(self, root: Tensor, shape: DynamicTree) -> tuple[Tensor, TreeBuffers]:
        """An EAGLE-2 dynamic tree (:mod:`medusa_train.tree.dynamic`) and its tokens.

        Returns:
            ``(tokens long [B, N], tree)``, N = ``shape.total + 1``, base ids, root first; ``tree`` the step's
            buffers (rank paths: node ``[i_0, i_1]`` is the rank-``i_1`` token drafted from node ``[i_0]``).
        """
        out, logits = self._commit(root)
        committed = self.cache_valid.shape[1]
        k = shape.topk
        device = root.device
        value, draft = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, k]
        values, drafts = [value], [draft]
        parent_of: list[int] = [-1] * k  # per drafted node (global index), its parent's index (-1: the root)
        rank_of: list[int] = list(range(k))
        entries: list[int] = []  # drafted entries in the drafter's cache, in order (global node indices)
        outs, source = out[:, None], torch.zeros(k, dtype=torch.long, device=device)  # each level node's parent row
        offset = 0
        for depth in range(1, shape.depth):
            level_values = values[-1]  # [B, n]
            chosen = level_values.sum(dim=0).topk(k).indices  # [k], by value summed over the rows
            chosen_host = chosen.tolist()
            queries = [offset + i for i in chosen_host]
            ancestors = [self._ancestors(q, parent_of) for q in queries]
            mask = torch.zeros(k, len(entries) + k, dtype=torch.bool)
            for i, q in enumerate(queries):
                mask[i, [e for e, node in enumerate(entries) if node in ancestors[i]]] = True
                mask[i, len(entries) + i] = True
            tokens = self.heads.to_base_tokens(drafts[-1][:, chosen])  # [B, k]
            logits, outs = self._level(outs[:, source[chosen]], tokens, depth, mask.to(device))
            entries += queries
            value, draft = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, k, k]
            offset += level_values.shape[1]
            values.append((level_values[:, chosen, None] + value).flatten(1))
            drafts.append(draft.flatten(1))
            parent_of += [q for q in queries for _ in range(k)]
            rank_of += list(range(k)) * k
            source = torch.arange(k, device=device).repeat_interleave(k)
        truncate(self.cache, committed)

        every = torch.cat(values, dim=1)  # [B, drafted], in depth order: a parent before its children
        order = every.sum(dim=0).sort(descending=True, stable=True).indices[: shape.total].tolist()
        path_of: dict[int, tuple[int, ...]] = {}
        for node in sorted(order):
            parent = parent_of[node]
            path_of[node] = (path_of[parent] if parent >= 0 else ()) + (rank_of[node],)
        tree = tree_of_paths(tuple(path_of.values()), device)
        node_of = {path: node for node, path in path_of.items()}
        index = torch.tensor([node_of[p] for p in tree.paths], dtype=torch.long, device=device)
        tokens = torch.cat([root[:, None], self.heads.to_base_tokens(torch.cat(drafts, dim=1)[:, index])], dim=1)
        return tokens, tree

    # --- helpers ------------------------------------------------------------------------------------------------

    def fuse(self, features: dict[str, Tensor]) -> Tensor:
        """The drafter's fused target feature ``[B, T, H]`` of target features ``{name: [B, T, H]}``."""
        return self.heads.fuse([features[name] for name in self.taps])

    def plan(self, tree: TreeBuffers) -> _Plan:
        """``tree``'s :func:`static_plan`, computed once per tree."""
        if self._tree is not tree:
            self._tree, self._plan = tree, static_plan(tree)
        return self._plan

    @staticmethod
    def _ancestors(node: int, parent_of: list[int]) -> set[int]:
        found = set()
        while node >= 0:
            found.add(node)
            node = parent_of[node]
        return found

    def _commit(self, root: Tensor) -> tuple[Tensor, Tensor]:
        """Run the drafter over the pending positions (their next tokens: the following position's, the root last),
        appending them to its cache; returns the last position's ``(out [B, H], logits [B, V'])``."""
        if self.pending is None:
            raise RuntimeError("Eagle3TreeDrafter.draft() before start() or twice without accept(): the decoder "
                               "starts every request and alternates draft and accept")
        p = self.pending
        batch, width = p.tokens.shape
        rows = torch.arange(batch, device=root.device)
        following = torch.cat([p.tokens[:, 1:], root[:, None]], dim=1).scatter(1, p.last[:, None], root[:, None])
        following = torch.where(p.valid, following, 0)  # padding reads any in-range token; it is masked
        causal = torch.ones(width, width, dtype=torch.bool, device=root.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=root.device)
        new = (causal[None] & p.valid[:, None, :]) | eye  # padding queries see themselves only
        mask = additive_mask(self.cache_valid, new, self.heads.dtype)
        logits, out = self.heads(p.hidden, self.model.embed(following), p.position, mask, self.cache)
        self.cache_valid = torch.cat([self.cache_valid, p.valid], dim=1)
        self.pending = None
        return out[rows, p.last], logits[rows, p.last]

    def _level(self, hidden: Tensor, tokens: Tensor, depth: int, drafted: Tensor) -> tuple[Tensor, Tensor]:
        """One level of drafted queries: ``hidden [B, Q, H]`` (their parents' ``out``), ``tokens [B, Q]`` (base ids),
        at position ``last + depth``, each attending to the committed slots and the drafted entries ``drafted``
        (bool ``[Q, E + Q]``) allows; appends Q entries. Returns ``(logits [B, Q, V'], out [B, Q, H])``."""
        batch, queries = tokens.shape
        mask = additive_mask(self.cache_valid, drafted, self.heads.dtype)
        position = (self.last + depth)[:, None].expand(batch, queries)
        return self.heads(hidden, self.model.embed(tokens), position, mask, self.cache)


__all__ = ["Eagle3TreeDrafter", "static_plan"]
