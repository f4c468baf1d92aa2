"""Candidate trees timed end to end: Medusa decoding of real prompts with each, the fastest kept.

The latency profile predicts a tree's speed as (replayed τ) / t(n), t(n) the bare pass over n tokens. What a decoding
step costs also holds what the profile leaves out (drafting, acceptance, cache compaction, the per-step work shared
with plain decoding), and the profile itself is a few passes on a machine that drifts: measured on a 2-core Xeon with
AMX in bf16, the profile read a pass over 12 tokens at 0.98 of one token while the decoder's steps over that tree cost
about 1.2 vanilla steps. The Medusa paper (Sec. 2.3.3) picks the tree size from the predicted acceleration over the
measured overhead of each size, as the profile does; here the sizes predicted near the best are then decoded for
real, taking turns on the same prompts, and the one with the most tokens per second of decoding replaces the
predicted best only when it is faster beyond the noise: the paired-bootstrap interval of their speed ratio over the
timed prompts (:mod:`inference.evaluation.intervals`) excludes 1 (:func:`choose`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

from inference.decoders.base import DecodeConfig
from inference.decoders.tree import TreeDecoder
from inference.evaluation.intervals import bounds_text, ratio_interval
from medusa_train.tree.buffers import TOPK

# Sizes timed: those predicted at least this share of the best predicted tokens/s (the profile's error seen so far
# is about 25%), among the measured profile sizes and the predicted best.
SHORTLIST_RATIO = 0.7
K = TypeVar("K", bound=Hashable)  # a timed table's key: a tree size, or a dynamic tree's shape


def shortlist(rates: dict[int, dict[str, float]], measured_sizes: Sequence[int], ratio: float = SHORTLIST_RATIO
              ) -> list[int]:
    """Tree sizes worth timing, in tokens a pass (nodes + the root), ascending.

    Args:
        rates: ``{n: {"tokens_per_s": float, ...}}`` predicted for every candidate size n
            (:func:`inference.tuning.search.best_tree_for_latency`'s table).
        measured_sizes: the sizes whose latency was measured rather than interpolated.
        ratio: keep sizes predicted at least ``ratio`` of the best.

    Returns:
        The best predicted size and every measured size predicted within ``ratio`` of it.

    Raises:
        ValueError: an empty table or a ratio outside (0, 1].
    """
    if not rates:
        raise ValueError("no candidate tree sizes to time")
    if not 0 < ratio <= 1:
        raise ValueError(f"shortlist ratio must be in (0, 1], got {ratio}")
    best = max(rates, key=lambda n: rates[n]["tokens_per_s"])
    floor = ratio * rates[best]["tokens_per_s"]
    return sorted({best} | {n for n in measured_sizes if n in rates and rates[n]["tokens_per_s"] >= floor})


def time_trees(model: Any, prompts: Sequence[Sequence[int]], trees: dict[int, list[list[int]]],
               max_new_tokens: int = 64) -> dict[int, dict[str, float]]:
    """Decode every prompt greedily with every tree (:func:`time_decoders`).

    Args:
        model: a :class:`~medusa_train.models.speculative.SpeculativeModel` in the dtype and on the kernels that will decode.
        prompts: token-id lists (non-empty).
        trees: ``{n: medusa_choices}``, n the tokens a pass (nodes + the root).
        max_new_tokens: tokens per reply; no EOS, so every tree decodes the same number of tokens.

    Returns:
        :func:`time_decoders`' table, by n.

    Raises:
        ValueError: no prompts, no trees, or an invalid tree (from :class:`~inference.decoders.tree.TreeDecoder`).
    """
    if not prompts or not trees:
        raise ValueError("time_trees needs at least one prompt and one tree")
    # The candidates every decoder takes per head: medusa-eval's, or more when a tree ranks deeper.
    deepest = max(1 + max(path) for choices in trees.values() for path in choices)
    topk = min(model.heads.spec.out_size, max(TOPK, deepest))
    return time_decoders({n: TreeDecoder(model, choices, topk=topk) for n, choices in trees.items()}, prompts,
                         max_new_tokens)


def time_decoders(decoders: dict[K, Any], prompts: Sequence[Sequence[int]], max_new_tokens: int = 64
                  ) -> dict[K, dict[str, Any]]:
    """Decode every prompt greedily with every decoder, the decoders taking turns per prompt (after one warm-up
    reply each), and total each one's decoding passes.

    Args:
        decoders: ``{key: decoder}`` (e.g. :class:`~inference.decoders.tree.TreeDecoder` over one tree each).
        prompts: token-id lists (non-empty).
        max_new_tokens: tokens per reply; no EOS, so every decoder decodes the same number of tokens.

    Returns:
        ``{key: {"tokens_per_s", "mean_accepted_tokens", "step_ms", "tokens", "seconds", "prompt_tokens",
        "prompt_seconds"}}``: tokens after the first over the seconds after the prefill (the prefill is the same for
        every decoder), τ, the mean step time, and the same tokens and seconds per prompt (``[prompts]``).

    Raises:
        ValueError: no prompts or no decoders.
    """
    if not prompts or not decoders:
        raise ValueError("timing needs at least one prompt and one decoder")
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    for decoder in decoders.values():
        decoder.generate(list(prompts[0]), config)  # warm-up: first calls pay allocation and kernel selection
    per_prompt: dict[K, dict[str, list]] = {key: {"tokens": [], "seconds": [], "passes": []} for key in decoders}
    for prompt in prompts:
        for key, decoder in decoders.items():
            result = decoder.generate(list(prompt), config)
            per_prompt[key]["tokens"].append(result.new_tokens - 1)
            per_prompt[key]["seconds"].append(result.wall_time_s - result.prefill_time_s)
            per_prompt[key]["passes"].append(result.forward_passes)
    out: dict[K, dict[str, Any]] = {}
    for key, p in per_prompt.items():
        tokens, seconds, passes = sum(p["tokens"]), max(sum(p["seconds"]), 1e-9), max(sum(p["passes"]), 1)
        out[key] = {"tokens_per_s": tokens / seconds, "mean_accepted_tokens": tokens / passes,
                    "step_ms": 1000.0 * seconds / passes, "tokens": tokens, "seconds": sum(p["seconds"]),
                    "prompt_tokens": p["tokens"], "prompt_seconds": p["seconds"]}
    return out


def fastest(timed: dict[K, dict[str, Any]]) -> K:
    """The key (a tree size, a dynamic tree's shape) with the most tokens per second in :func:`time_decoders`'
    table."""
    return max(timed, key=lambda n: timed[n]["tokens_per_s"])


def choose(timed: dict[K, dict[str, Any]], predicted: K) -> tuple[K, dict[str, Any] | None]:
    """The size to keep: the fastest timed when its speed over the predicted best's is beyond the noise (the paired
    interval over the timed prompts excludes 1), else the predicted best.

    Args:
        timed: :func:`time_decoders`' table (with ``prompt_tokens`` and ``prompt_seconds``), by tree size (tokens
            a pass) or by any other key (a dynamic tree's shape).
        predicted: the predicted best size (or the reference key), one of the timed keys.

    Returns:
        ``(size, margin)``: ``margin`` the fastest's speed over the predicted best's
        (:meth:`~inference.evaluation.intervals.Interval.record`), None when they are the same size.

    Raises:
        ValueError: ``predicted`` was not timed.
    """
    if predicted not in timed:
        raise ValueError(f"the predicted best size {predicted} was not timed (timed: {sorted(timed)})")
    best = fastest(timed)
    if best == predicted:
        return best, None
    margin = ratio_interval(timed[best]["prompt_tokens"], timed[best]["prompt_seconds"],
                            timed[predicted]["prompt_tokens"], timed[predicted]["prompt_seconds"])
    return (best if margin.separated else predicted), margin.record()


def describe_choice(margin: dict[str, Any] | None, reference: str = "predicted best", kept: str = "prediction"
                    ) -> str:
    """Why :func:`choose` kept its size, in words, from its ``margin`` record (``reference``: what the fastest was
    measured against, ``kept``: what is kept within the noise)."""
    if margin is None:
        return f"the fastest decoded is the {reference}"
    return (f"the fastest decoded ran {margin['estimate']:.3f}x the {reference}'s speed "
            f"{bounds_text(margin, '.3f')}: "
            + ("beyond the noise, kept" if margin["separated"] else f"within the noise, the {kept} kept"))


__all__ = ["SHORTLIST_RATIO", "choose", "describe_choice", "fastest", "shortlist", "time_decoders", "time_trees"]
