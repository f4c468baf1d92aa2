"""Head accuracy by rank: how often head k's rank-i candidate is the token the base model itself produces.

This is the quantity the tree is tuned from (Medusa paper, Sec. 3.3.3): ``acc[k][i]`` = P(head k's i-th most likely
token at position t equals the target token at t + k + 2). Measured on the base model's own greedy continuations,
the tokens greedy verification will have to match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_train.model import MedusaModel


def rank_hits(head_logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Count rank hits of every head.

    Args:
        head_logits: ``[K, B, T, V']`` head logits at every position t (head-vocabulary space).
        tokens: ``[B, T]`` long target tokens in head-vocabulary space (-1 where a token is outside a reduced vocab).
        valid: ``[B, T]`` bool, positions t whose prediction counts (t + k + 2 must also be in range: handled here).
        topk: ranks to count (clipped to V').

    Returns:
        ``(hits [K, topk] long, totals [K] long)``: ``hits[k][i]`` counts positions where head k's rank-i token equals
        ``tokens[:, t + k + 2]``; ``totals[k]`` counts the positions considered for head k.
    """
    K, B, T, V = head_logits.shape
    topk = min(topk, V)
    hits = torch.zeros(K, topk, dtype=torch.long)
    totals = torch.zeros(K, dtype=torch.long)
    for k in range(K):
        shift = k + 2
        if T <= shift:
            continue
        ranked = head_logits[k, :, : T - shift].topk(topk, dim=-1).indices  # [B, T-shift, topk]
        target = tokens[:, shift:]  # [B, T-shift]
        mask = valid[:, : T - shift] & (target >= 0)
        match = (ranked == target.unsqueeze(-1)) & mask.unsqueeze(-1)
        hits[k] += match.sum(dim=(0, 1)).cpu()
        totals[k] += mask.sum().cpu()
    return hits, totals


def to_head_vocab(model: MedusaModel, tokens: torch.Tensor) -> torch.Tensor:
    """Base token ids ``[...]`` -> head-vocabulary indices (-1 for tokens outside a reduced vocabulary)."""
    token_map = model.heads.token_map
    if token_map is None:
        return tokens
    lookup = torch.full((model.heads.spec.vocab_size,), -1, dtype=torch.long, device=tokens.device)
    lookup[token_map.to(tokens.device)] = torch.arange(token_map.numel(), device=tokens.device)
    return lookup[tokens]


@torch.no_grad()
def measure_head_accuracy(
    model: MedusaModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    topk: int = 10,
    eos_token_id: int | None = None,
) -> dict:
    """``acc[k][i]`` on the base model's own greedy continuations of ``prompts``.

    Each prompt is continued greedily by the base model (HF ``generate``), then one teacher-forced pass over prompt +
    continuation gives every head's logits at every continuation position t (from the last prompt token on).

    Returns:
        ``{"acc": [[float]*topk]*K, "positions": [int]*K, "prompts": int, "new_tokens": int, "topk": int}``.

    Raises:
        ValueError: no prompts, or an empty prompt.
    """
    if not prompts:
        raise ValueError("measure_head_accuracy needs at least one prompt")
    device = model.lm_head.weight.device
    K = model.heads.spec.num_heads
    hits = torch.zeros(K, min(topk, model.heads.spec.out_size), dtype=torch.long)
    totals = torch.zeros(K, dtype=torch.long)
    new_tokens = 0
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        ids = torch.tensor([list(prompt)], device=device)
        out = model.base.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=eos_token_id, pad_token_id=eos_token_id if eos_token_id is not None else 0,
        )
        new_tokens += out.shape[1] - ids.shape[1]
        heads = model(out, with_heads=True).head_logits  # [K, 1, T, V']
        valid = torch.zeros_like(out, dtype=torch.bool)
        valid[:, ids.shape[1] - 1 :] = True
        h, t = rank_hits(heads, to_head_vocab(model, out), valid, topk)
        hits += h
        totals += t
    acc = (hits.double() / totals.clamp(min=1).unsqueeze(-1).double()).tolist()
    return {"acc": acc, "positions": totals.tolist(), "prompts": len(prompts), "new_tokens": new_tokens,
            "topk": hits.shape[1]}
