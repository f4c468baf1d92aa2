"""Speculative decoding's counters in an engine, turned into our per-pass record: how many tokens each decoding pass
emitted (:mod:`inference.decoders.base`'s ``accepted_lengths``), from the counts vLLM and llama.cpp keep.

Both engines count, per request, D verifying passes that carried drafts (``num_drafts``), A accepted drafts and the
accepted drafts per draft position. Each such pass emits its accepted drafts and one more token; a pass without a
draft (vLLM's n-gram or llama.cpp's n-gram and draft-probability cut found nothing to draft) is not counted by
either, and emits one token. So a reply of N tokens (the prefill's first one apart) came from the D chains (their
lengths rebuilt from the per-position counts, longest first: their order is not known) and ``N - 1 - (D + A)`` plain
passes, and ``τ = (N - 1) / passes``. Where an EOS or the token budget cut the reply inside an accepted chain, the
engines have counted the drafts past it: the longest lengths are then shortened until they sum to ``N - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def accepted_lengths_from_counts(num_drafts: int, accepted_per_pos: Sequence[int]) -> list[int]:
    """Tokens emitted by each of ``num_drafts`` verifying passes, from vLLM's per-position acceptance counts.

    A chain accepts draft ``j`` only after drafts ``0..j-1``, so ``accepted_per_pos[j]`` passes accepted at least
    ``j + 1`` drafts; each pass also emits one bonus (or recovered) token.

    Args:
        num_drafts: D, verifying passes that carried drafts.
        accepted_per_pos: ``[K]``, non-increasing, each in ``[0, D]``.

    Returns:
        D lengths in ``[1, K + 1]``, longest first.

    Raises:
        ValueError: counts that no chain produces (increasing, or above ``num_drafts``).
    """
    counts = [num_drafts, *accepted_per_pos, 0]
    if any(b > a for a, b in zip(counts, counts[1:])) or min(counts) < 0:
        raise ValueError(f"accepted_per_pos {list(accepted_per_pos)} is not a chain's (drafts: {num_drafts})")
    lengths: list[int] = []
    for j in range(len(counts) - 2, -1, -1):  # exactly j accepted: counts[j] - counts[j + 1] passes
        lengths.extend([j + 1] * (counts[j] - counts[j + 1]))
    return lengths


def pass_lengths(new_tokens: int, spec: dict[str, Any]) -> list[int]:
    """Tokens each decoding pass emitted, from a request's counters (see the module docstring: a pass without drafts emits one token).

    Args:
        new_tokens: N, the reply's length (the prefill's token included).
        spec: ``num_drafts`` D, ``num_accepted_tokens`` A and ``accepted_per_pos`` ``[K]`` of the request.

    Returns:
        lengths summing to ``N - 1`` (none for ``N <= 1``): the D chains' (longest first), then the plain passes'.

    Raises:
        ValueError: counts that no chain produces (as :func:`accepted_lengths_from_counts`), or per-position counts
            that do not add up to A.
    """
    drafts, accepted, per_pos = spec["num_drafts"], spec["num_accepted_tokens"], spec["accepted_per_pos"]
    if sum(per_pos) != accepted:
        raise ValueError(f"accepted_per_pos {per_pos} does not add up to the {accepted} accepted drafts")
    lengths = accepted_lengths_from_counts(drafts, per_pos) if drafts else []
    total = max(new_tokens - 1, 0)
    lengths += [1] * max(total - sum(lengths), 0)
    excess = sum(lengths) - total
    for i in range(len(lengths)):  # drafts counted past an EOS (or a reply of one token): trim the longest
        cut = min(excess, lengths[i] - 1)
        lengths[i] -= cut
        excess -= cut
    return lengths[:total]  # still over only when every length is 1


__all__ = ["accepted_lengths_from_counts", "pass_lengths"]
