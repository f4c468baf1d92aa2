"""Why a lossless decoder's greedy reply left vanilla's: a near-tie under rounding, or something else.

Greedy Medusa, draft and lookahead decoding verify with the target's argmax, so in exact arithmetic their replies are
vanilla's. In floating point they are not quite: the verification pass computes a position's logits in a k-token
pass, vanilla in a 1-token pass, and the kernels round differently (different GEMM blockings; in bf16, 8 bits of
mantissa). Where vanilla's top two logits are closer than that rounding, the argmax can flip and the replies part.

- :func:`rounding_noise` measures the rounding: over many positions of real sequences, the change of the top-2 logit
  gap between a 1-token pass and a k-token pass of the same prefix over the same KV cache (the k-token pass with an
  explicit 4-D mask, as a tree pass has).
- :func:`explain_divergences` finds, for each decoder and reply, the first token that differs from vanilla's and
  reads vanilla's top-2 gap there (:attr:`~inference.decoders.base.DecodeResult.top2_gaps`, recorded by vanilla while
  decoding). A divergence is a **near-tie** when that gap is at most the largest gap change measured; any other is
  flagged: a real bug would show as one.

Shapes: T sequence, k tokens of the multi-token pass, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from inference.evaluation.eval_config import BASELINE
from medusa_train.tree.kv_cache import preallocated_cache
from medusa_train.tree.masks import additive_mask


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` differs from ``reference`` (where the shorter ends, if one is a
    prefix of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def _logits(base: Any, cache: Any, tokens: Tensor, start: int, mask: Tensor | None) -> Tensor:
    """The lm_head over the first new position of a pass over ``tokens [1, n]`` at positions ``start..``: ``[V]``."""
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
    hidden = base.base_model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                             use_cache=True).last_hidden_state
    return base.get_output_embeddings()(hidden[:, :1])[0, 0].float()


@torch.no_grad()
def rounding_noise(base: Any, sequences: Sequence[tuple[Sequence[int], int]], ks: Sequence[int],
                   positions: int = 64) -> dict[str, Any]:
    """How much the top-2 logit gap moves between a 1-token and a k-token pass of the same prefix.

    Args:
        base: the target ``*ForCausalLM`` (in the dtype and on the kernels the decoders ran on).
        sequences: ``(token ids, prompt length)`` pairs: a prompt and a reply to it; positions are taken in the reply.
        ks: the multi-token pass sizes to compare against (e.g. 2 and the Medusa tree's N); each >= 2.
        positions: positions measured in all, spread evenly over the sequences' replies.

    Returns:
        ``{"ks", "positions", "max_gap_change", "p99_gap_change", "median_gap_change", "max_top_logit_change"}``
        (logit units; ``positions`` is how many were measured, 0 when the replies are too short).
    """
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 2:
        raise ValueError(f"ks must be sizes >= 2 of the multi-token pass, got {list(ks)}")
    device = base.get_output_embeddings().weight.device
    dtype = base.get_output_embeddings().weight.dtype
    usable = [(list(ids), p) for ids, p in sequences if len(ids) - p >= 1 and p >= 1]
    per_sequence = max(1, -(-positions // max(len(usable), 1)))
    gap_changes: list[float] = []
    top_changes: list[float] = []
    measured = 0
    for ids, prompt in usable:
        reply = len(ids) - prompt
        picked = sorted({prompt + (i * reply) // per_sequence for i in range(min(per_sequence, reply))})
        picked = picked[: positions - measured]
        if not picked:
            break
        measured += len(picked)
        tokens = torch.tensor(ids, device=device)[None]
        cache = preallocated_cache(len(ids) + max(ks))
        done = 0  # positions in the cache
        for p in picked:
            if p > done:  # fill the cache up to p in one pass
                _logits(base, cache, tokens[:, done:p], done, None)
                done = p
            one = _logits(base, cache, tokens[:, p:p + 1], p, None)  # vanilla's pass at p
            cache.crop(-1)
            top2 = one.topk(2).indices
            gap = float(one[top2[0]] - one[top2[1]])
            for k in ks:
                chunk = tokens[:, p:p + k]
                chunk = torch.cat([chunk, chunk[:, -1:].expand(1, k - chunk.shape[1])], dim=1)  # padding after p
                valid = torch.ones(1, p, dtype=torch.bool, device=device)
                causal = torch.ones(k, k, dtype=torch.bool, device=device).tril()
                many = _logits(base, cache, chunk, p, additive_mask(valid, causal, dtype))
                cache.crop(-k)
                gap_changes.append(abs(gap - float(many[top2[0]] - many[top2[1]])))
                top_changes.append(abs(float(one[top2[0]] - many[top2[0]])))
    if not gap_changes:
        return {"ks": ks, "positions": 0, "max_gap_change": None, "p99_gap_change": None,
                "median_gap_change": None, "max_top_logit_change": None}
    changes = torch.tensor(gap_changes)
    return {"ks": ks, "positions": len(gap_changes) // len(ks), "max_gap_change": float(changes.max()),
            "p99_gap_change": float(changes.quantile(0.99)), "median_gap_change": float(changes.median()),
            "max_top_logit_change": max(top_changes)}


def find_divergences(units: Sequence[dict[str, dict[str, Any]]], baseline: str = BASELINE) -> dict[str, list[dict]]:
    """For each decoder but the baseline, its replies that differ from the baseline's.

    Args:
        units: ``{decoder: results row}`` per (prompt, turn), every decoder present (greedy runs).

    Returns:
        ``{decoder: [{"prompt_id", "turn", "position", "vanilla_gap"}]}``; ``vanilla_gap`` is the baseline's top-2
        logit gap at ``position`` (None when its row has no ``top2_gaps``, e.g. a resumed older run).
    """
    out: dict[str, list[dict]] = {}
    for unit in units:
        reference = unit[baseline]
        gaps = reference.get("top2_gaps") or []
        for name, row in unit.items():
            if name == baseline:
                continue
            position = first_divergence(reference["tokens"], row["tokens"])
            out.setdefault(name, [])
            if position is not None:
                out[name].append({"prompt_id": str(row["prompt_id"]), "turn": int(row["turn"]), "position": position,
                                  "vanilla_gap": gaps[position] if position < len(gaps) else None})
    return out


def explain_divergences(divergences: dict[str, list[dict]], noise: dict[str, Any] | None,
                        replies: int) -> dict[str, Any]:
    """``summary.json``'s ``divergences``: per decoder, how many replies left the baseline's and how many of those
    were near-ties (vanilla's gap at most the measured ``max_gap_change``); the others are listed.

    Returns:
        ``{"rounding_noise": noise, "threshold": float | None, "decoders": {name: {"replies", "diverged",
        "near_ties", "not_near_ties": [...], "unexplained": int}}}``; ``unexplained`` counts divergences without a
        recorded gap or without a noise measurement.
    """
    threshold = None if not noise else noise.get("max_gap_change")
    table: dict[str, Any] = {}
    for name, items in divergences.items():
        known = [d for d in items if d["vanilla_gap"] is not None and threshold is not None]
        near = [d for d in known if d["vanilla_gap"] <= threshold]
        table[name] = {"replies": replies, "diverged": len(items), "near_ties": len(near),
                       "not_near_ties": [d for d in known if d["vanilla_gap"] > threshold],
                       "unexplained": len(items) - len(known)}
    return {"rounding_noise": noise, "threshold": threshold, "decoders": table}


__all__ = ["explain_divergences", "find_divergences", "first_divergence", "rounding_noise"]
