"""The composite tree's budget split (heads' nodes, lookup length, lookup matches), chosen by decoding.

A composite step (:mod:`inference.proposers.composite`) spends a node budget on prompt lookup's drafts first and on
the heads' best tree for the rest. No accuracy table predicts how often the lookup matches and is right, so the
split is chosen as a dynamic tree's shape is (:mod:`inference.tuning.dynamic`): the tuning prompts are decoded
with a short list of splits, taking turns, and the fastest is kept when it beats the reference beyond the noise
(:func:`inference.tuning.timed.choose`).

A split is ``(heads, lookup_length, lookup_matches)``: ``heads`` the drafter's nodes when the lookup drafts fill
their share, so the budget is ``nodes = heads + lookup_length * lookup_matches``; when the lookup finds no match
the heads take the whole budget, so their tree is the best tree of ``nodes`` nodes
(:func:`~inference.tuning.search.greedy_tree`, best node first). The reference split is the static tree kept by
the same tuning run, with transformers' prompt lookup (10 tokens, one match; both cut to fit ``max_nodes``); the
shortlist changes one factor at a time: ``len(heads) + len(lengths) + len(matches) - 2`` splits at most.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from medusa_train.tree.composite import LOOKUP_LENGTH, LOOKUP_MATCHES, CompositeTree

log = logging.getLogger(__name__)

Split = tuple[int, int, int]  # (heads' nodes, lookup_length, lookup_matches)


def composite_shortlist(kept_nodes: int, heads: Sequence[int] | None, lengths: Sequence[int],
                        matches: Sequence[int], max_nodes: int) -> tuple[Split, list[Split]]:
    """The reference split and the splits to decode (see the module docstring).

    Args:
        kept_nodes: the static tree's nodes kept by the tuning run (the reference's heads).
        heads: the heads' node counts to try; None: half, once and twice ``kept_nodes``.
        lengths, matches: the lookup lengths and match counts to try (each >= 1).
        max_nodes: the largest budget (``heads + length * matches``) considered.

    Returns:
        ``(reference, splits)``, the reference first (its lookup length and heads cut to fit ``max_nodes``); a
        split over ``max_nodes`` is left out.

    Raises:
        ValueError: an empty list, or ``max_nodes`` < 2 (no room for one heads' node and one lookup token; the
            settings named).
    """
    for name, values in (("composite_heads", heads), ("composite_lengths", lengths),
                         ("composite_matches", matches)):
        if values is not None and not values:
            raise ValueError(f"{name} is empty: give at least one value" + (" (or null)" if name == "composite_heads"
                                                                             else ""))
    if max_nodes < 2:
        raise ValueError(f"max_nodes={max_nodes} leaves no room for a composite tree (at least one heads' node and "
                         "one lookup token): raise max_nodes, or set composite=false")
    length = min(LOOKUP_LENGTH, max_nodes - 1)  # transformers' 10 tokens, shorter when the budget is smaller
    kept_nodes = max(1, min(kept_nodes, max_nodes - length * LOOKUP_MATCHES))  # the reference fits the budget
    heads = sorted({max(1, kept_nodes // 2), kept_nodes, 2 * kept_nodes} if heads is None else set(heads))
    reference = (kept_nodes, length, LOOKUP_MATCHES)
    splits = [reference]
    around = ([(h, length, LOOKUP_MATCHES) for h in heads] + [(kept_nodes, n, LOOKUP_MATCHES) for n in lengths]
              + [(kept_nodes, length, m) for m in matches])
    for split in around:
        if split not in splits and sum_nodes(split) <= max_nodes:
            splits.append(split)
    return reference, splits


def sum_nodes(split: Split) -> int:
    """The node budget of a split: ``heads + lookup_length * lookup_matches``."""
    heads, length, matches = split
    return heads + length * matches


def composite_of(split: Split) -> CompositeTree:
    """The :class:`~medusa_train.tree.composite.CompositeTree` of a split."""
    heads, length, matches = split
    return CompositeTree(nodes=sum_nodes(split), lookup_length=length, lookup_matches=matches)


def tune_composite(model: Any, prompts: Sequence[Sequence[int]], acc: Sequence[Sequence[float]], reference: Split,
                   splits: Sequence[Split], max_new_tokens: int, topk: int) -> dict[str, Any]:
    """The composite tree's split for ``model`` on this hardware, as ``composite_tree.json`` records it.

    Args:
        model: a :class:`~medusa_train.models.speculative.SpeculativeModel` in the dtype and on the kernels that will decode.
        prompts: the timed tuning prompts (token-id lists); none: the reference is kept undecoded.
        acc: the heads' accuracy table (``head_accuracy.json``'s ``acc``), for each budget's best heads' tree.
        reference, splits: :func:`composite_shortlist`'s.
        max_new_tokens: tokens per timed reply.
        topk: candidates per head the decoders take (at least every rank of the trees).

    Returns:
        ``{"nodes", "lookup_length", "lookup_matches", "max_matching_ngram_size", "heads_nodes", "medusa_choices",
        "tokens_per_s", "mean_accepted_tokens", "chosen"}``: the kept split, the heads' tree of its budget (best
        node first), its speed and τ on the prompts (None when nothing was decoded), and ``chosen`` as
        :func:`~inference.tuning.dynamic.tune_dynamic_tree` records it (``reference``, ``timed`` rows,
        ``timed_prompts``, ``timed_new_tokens``, ``margin``).
    """
    from inference.decoders.tree import TreeDecoder
    from inference.tuning.search import greedy_tree
    from inference.tuning.timed import choose, describe_choice, time_decoders

    def record(split: Split) -> dict[str, Any]:
        return {**composite_of(split).as_dict(), "heads_nodes": split[0]}

    if not prompts:
        return {**record(reference), "medusa_choices": greedy_tree(acc, sum_nodes(reference)), "tokens_per_s": None,
                "mean_accepted_tokens": None, "chosen": {"by": "default", "reference": record(reference)}}
    tree = {split: greedy_tree(acc, sum_nodes(split)) for split in splits}  # the heads' best tree of each budget
    width = max(1 + max(p) for choices in tree.values() for p in choices)
    topk = min(model.heads.spec.out_size, max(topk, width))
    decoders = {split: TreeDecoder(model, tree[split], topk=topk, composite=composite_of(split)) for split in splits}
    timed = time_decoders(decoders, prompts, max_new_tokens)
    kept, margin = choose(timed, reference)
    log.info("decoded %d tuning prompts with %d composite splits: kept %s (the reference: %s; %s)", len(prompts),
             len(timed), record(kept), record(reference), describe_choice(margin, "reference", "reference"))
    return {**record(kept), "medusa_choices": tree[kept], "tokens_per_s": timed[kept]["tokens_per_s"],
            "mean_accepted_tokens": timed[kept]["mean_accepted_tokens"],
            "chosen": {"by": "timed", "reference": record(reference),
                       "timed": [{**record(split), **row} for split, row in timed.items()],
                       "timed_prompts": len(prompts), "timed_new_tokens": max_new_tokens, "margin": margin}}


__all__ = ["composite_of", "composite_shortlist", "sum_nodes", "tune_composite"]
