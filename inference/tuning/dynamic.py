"""The shape of an EAGLE-2 dynamic tree (depth, topk, total) for drafters that grow one, chosen by decoding.

A dynamic tree (:mod:`medusa_train.tree.dynamic`) is grown anew every step from the drafter's own confidence, so no
accuracy table predicts its τ as one predicts a static tree's (:mod:`inference.tuning.search`): its shape is
chosen by decoding the tuning prompts with each shape of a small shortlist, as the static tree's size is
(:mod:`inference.tuning.timed`), and the fastest is kept when it beats the reference shape beyond the noise
(:func:`inference.tuning.timed.choose`).

The shortlist (:func:`dynamic_shortlist`) is the reference shape and every shape that differs from it in one of the
three settings (one factor at a time): ``len(depths) + len(topks) + len(totals) - 2`` shapes at most, where the full
grid would be their product. The reference is the grid's middle: the lower median depth, the largest topk, the lower
median total. A total below the depth keeps that many nodes of at most that depth, so such a shape is taken at
``depth = total`` (the same tree, drafted with fewer drafter calls); a total above what the depth and topk draft
(``topk + (depth - 1) * topk**2``) is left out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from medusa_train.tree.dynamic import DynamicTree

log = logging.getLogger(__name__)


def _shape(depth: int, topk: int, total: int) -> DynamicTree | None:
    """The shape ``(min(depth, total), topk, total)``, or None when ``total`` exceeds what it drafts."""
    depth = min(depth, total)
    return DynamicTree(depth, topk, total) if total <= topk + (depth - 1) * topk ** 2 else None


def dynamic_shortlist(depths: Sequence[int], topks: Sequence[int], totals: Sequence[int]
                      ) -> tuple[DynamicTree, list[DynamicTree]]:
    """The reference shape and the shapes to decode (see the module docstring).

    Args:
        depths, topks, totals: the candidate values of each setting (``dynamic_depths``, ``dynamic_topks``, and the
            totals :meth:`~inference.tuning.tune_tree_config.TuneTreeConfig.dynamic_tree_totals` gives), >= 1.

    Returns:
        ``(reference, shapes)``: ``shapes`` distinct, the reference first.

    Raises:
        ValueError: an empty list, or a grid whose middle drafts fewer nodes than every total (the settings named).
    """
    for name, values in (("dynamic_depths", depths), ("dynamic_topks", topks), ("dynamic_totals", totals)):
        if not values:
            raise ValueError(f"{name} is empty: give at least one value")
    depths, topks, totals = sorted(set(depths)), sorted(set(topks)), sorted(set(totals))
    depth, topk = depths[(len(depths) - 1) // 2], topks[-1]
    feasible = [n for n in totals if _shape(depth, topk, n) is not None]
    if not feasible:
        raise ValueError(f"no total in {totals} fits a dynamic tree of depth {depth} and topk {topk} (at most "
                         f"{topk + (depth - 1) * topk ** 2} nodes): add smaller totals (dynamic_totals, or "
                         "latency_sizes) or larger dynamic_depths / dynamic_topks")
    total = feasible[(len(feasible) - 1) // 2]
    reference = _shape(depth, topk, total)
    shapes = [reference]
    around = ([(d, topk, total) for d in depths] + [(depth, k, total) for k in topks]
              + [(depth, topk, n) for n in totals])
    for shape in (_shape(*values) for values in around):
        if shape is not None and shape not in shapes:
            shapes.append(shape)
    return reference, shapes


def time_dynamic_trees(model: Any, prompts: Sequence[Sequence[int]], shapes: Sequence[DynamicTree],
                       max_new_tokens: int) -> dict[DynamicTree, dict[str, Any]]:
    """Decode every prompt greedily over a dynamic tree of every shape, taking turns
    (:func:`~inference.tuning.timed.time_decoders`, whose table this is, by shape).

    Raises:
        ValueError: no prompts or shapes; a shape the model's drafter cannot grow
            (:class:`~inference.decoders.tree.TreeDecoder`).
    """
    from inference.decoders.tree import TreeDecoder
    from inference.tuning.timed import time_decoders

    return time_decoders({shape: TreeDecoder(model, None, dynamic_tree=shape) for shape in shapes}, prompts,
                         max_new_tokens)


def tune_dynamic_tree(model: Any, prompts: Sequence[Sequence[int]], reference: DynamicTree,
                      shapes: Sequence[DynamicTree], max_new_tokens: int) -> dict[str, Any]:
    """The dynamic tree's shape for ``model`` on this hardware, as ``dynamic_tree.json`` records it.

    Args:
        model: a :class:`~medusa_train.models.speculative.SpeculativeModel` whose drafter grows dynamic trees, in the dtype and
            on the kernels that will decode.
        prompts: the timed tuning prompts (token-id lists); none: the reference is kept undecoded.
        reference, shapes: :func:`dynamic_shortlist`'s.
        max_new_tokens: tokens per timed reply.

    Returns:
        ``{"depth", "topk", "total", "tokens_per_s", "mean_accepted_tokens", "chosen"}``: the kept shape, its speed
        and τ on the prompts (None when nothing was decoded), and ``chosen``: ``by`` (``timed``, or ``default`` with
        no prompts), the ``reference`` shape, and with ``timed``: ``timed`` (one row per decoded shape, the shape's
        fields and :func:`~inference.tuning.timed.time_decoders`' row), ``timed_prompts``, ``timed_new_tokens``
        and ``margin`` (the fastest over the reference, with its interval; None when the reference is the fastest).

    Raises:
        ValueError: as :func:`time_dynamic_trees`.
    """
    from inference.tuning.timed import choose, describe_choice

    if not prompts:
        return {**reference.as_dict(), "tokens_per_s": None, "mean_accepted_tokens": None,
                "chosen": {"by": "default", "reference": reference.as_dict()}}
    timed = time_dynamic_trees(model, prompts, shapes, max_new_tokens)
    kept, margin = choose(timed, reference)
    log.info("decoded %d tuning prompts over %d dynamic tree shapes: kept %s (the reference: %s; %s)", len(prompts),
             len(timed), kept.as_dict(), reference.as_dict(), describe_choice(margin, "reference", "reference"))
    return {**kept.as_dict(), "tokens_per_s": timed[kept]["tokens_per_s"],
            "mean_accepted_tokens": timed[kept]["mean_accepted_tokens"],
            "chosen": {"by": "timed", "reference": reference.as_dict(),
                       "timed": [{**shape.as_dict(), **row} for shape, row in timed.items()],
                       "timed_prompts": len(prompts), "timed_new_tokens": max_new_tokens, "margin": margin}}


def prefer_faster_kind(dynamic: dict[str, Any], static_row: dict[str, Any], static_nodes: int) -> None:
    """Record in ``dynamic`` (:func:`tune_dynamic_tree`'s, timed) whether the static tree kept beside it decoded
    faster beyond the noise on the same prompts: ``chosen.over_static`` (the dynamic tree's speed over the static
    tree's, with its paired interval) and ``chosen.static_faster`` (True when that interval lies below 1). The decoder
    then keeps the static tree by default (:func:`inference.decoders.choices.resolve_dynamic_tree`): the dynamic tree
    is the default for drafters that grow one unless the static tree is measurably faster.

    Args:
        static_row: the kept static tree's row of :func:`~inference.tuning.timed.time_trees`' table.
        static_nodes: its nodes below the root.
    """
    from inference.evaluation.intervals import bounds_text, ratio_interval

    chosen = dynamic["chosen"]
    row = timed_table(chosen)[DynamicTree(dynamic["depth"], dynamic["topk"], dynamic["total"])]
    margin = ratio_interval(row["prompt_tokens"], row["prompt_seconds"], static_row["prompt_tokens"],
                            static_row["prompt_seconds"])
    chosen["over_static"] = {"static_nodes": static_nodes, **margin.record()}
    chosen["static_faster"] = bool(margin.separated and margin.estimate < 1)
    print(f"the dynamic tree ran {margin.estimate:.3f}x the static tree's speed ({static_nodes} nodes) "
          f"{bounds_text(chosen['over_static'], '.3f')}: the decoder's default is the "
          + ("static tree (faster beyond the noise)" if chosen["static_faster"] else "dynamic tree"))


def timed_table(chosen: dict[str, Any]) -> dict[DynamicTree, dict[str, Any]]:
    """The timed table ``{shape: row}`` of a ``chosen`` record (:func:`tune_dynamic_tree`), as
    :func:`~inference.tuning.timed.choose` takes it."""
    return {DynamicTree(row["depth"], row["topk"], row["total"]): row for row in chosen.get("timed", [])}


__all__ = ["dynamic_shortlist", "prefer_faster_kind", "time_dynamic_trees", "timed_table", "tune_dynamic_tree"]
