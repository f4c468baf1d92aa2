"""Head accuracy by rank: how often head k's rank-i candidate is the token the base model itself produces.

This is the quantity the tree is tuned from (Medusa paper, Sec. 2.3.3): ``acc[k][i]`` = P(head k's i-th most likely
token at position t equals the target token at t + k + 2). Measured on the base model's own greedy continuations,
the tokens greedy verification will have to match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_train.models.generation import greedy_generate, length_batches
from medusa_train.models.heads_base import to_head_vocab
from medusa_train.models.speculative import SpeculativeModel
from medusa_train.tree.buffers import TOPK


def target_ranks(head_logits: torch.Tensor, tokens: torch.Tensor, topk: int) -> torch.Tensor:
    """The rank of each target among each head's top-k candidates.

    Args:
        head_logits: ``[K, B, T, V']`` head logits at every position t (head-vocabulary space).
        tokens: ``[B, T]`` long target tokens in head-vocabulary space (-1 where a token is outside a reduced vocab).
        topk: ranks to look at (clipped to V').

    Returns:
        ``[K, B, T]`` long: ``ranks[k, b, t] = i`` when head k's rank-i token at t is ``tokens[b, t + k + 2]``, and -1
        when it is none of the top k, the target is outside the head vocabulary (a miss for the decoder too), or
        ``t + k + 2`` is past the end.
    """
    K, B, T, V = head_logits.shape
    topk = min(topk, V)
    ranks = torch.full((K, B, T), -1, dtype=torch.long)
    for k in range(K):
        shift = k + 2
        if T <= shift:
            continue
        ranked = head_logits[k, :, : T - shift].topk(topk, dim=-1).indices  # [B, T-shift, topk]
        target = tokens[:, shift:]  # [B, T-shift]
        match = (ranked == target.unsqueeze(-1)) & (target >= 0).unsqueeze(-1)
        found = match.any(dim=-1)
        ranks[k, :, : T - shift] = torch.where(found, match.int().argmax(dim=-1), -1).cpu()
    return ranks


def count_rank_hits(ranks: torch.Tensor, valid: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank hits from :func:`target_ranks`.

    Args:
        ranks: ``[K, B, T]`` long, from :func:`target_ranks`.
        valid: ``[B, T]`` bool, positions t whose prediction counts (t + k + 2 must also be in range: handled here).
        topk: width of the table.

    Returns:
        ``(hits [K, topk] long, totals [K] long)``: ``hits[k][i]`` counts positions where head k's rank-i token equals
        the token at t + k + 2; ``totals[k]`` counts the positions considered for head k, a target outside a reduced
        head vocabulary included (it is a miss).
    """
    K, _, T = ranks.shape
    hits = torch.zeros(K, topk, dtype=torch.long)
    totals = torch.zeros(K, dtype=torch.long)
    for k in range(K):
        in_range = valid[:, : max(T - k - 2, 0)].cpu()
        totals[k] = in_range.sum()
        kept = ranks[k, :, : in_range.shape[1]][in_range]
        hits[k] = torch.bincount(kept[kept >= 0], minlength=topk)[:topk]
    return hits, totals


@torch.no_grad()
def measure_head_accuracy(
    model: SpeculativeModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    topk: int = TOPK,
    eos_token_id: int | None = None,
    batch_size: int = 1,
    pad_token_id: int | None = None,
    max_batch_tokens: int = 4096,
) -> dict:
    """``acc[k][i]`` on the base model's own greedy continuations of ``prompts``.

    Each prompt is continued greedily by the base model (HF ``generate``, ``batch_size`` prompts of similar length at
    a time, left-padded: :func:`medusa_train.models.generation.greedy_generate`), then one teacher-forced pass over prompt +
    continuation, one prompt at a time and unpadded, gives every head's logits at every continuation position t (from
    the last prompt token on).

    Args:
        model: the base with its heads.
        prompts: token-id lists.
        max_new_tokens: continuation length (fewer when ``eos_token_id`` ends it).
        topk: ranks counted per head.
        eos_token_id: ends a continuation (included in it), or None.
        batch_size: prompts per ``generate`` call. Batched greedy tokens can differ from one-at-a-time ones where
            two logits nearly tie (padding changes the rounding); 1 reproduces the decoder's own continuations.
        pad_token_id: pads batches (default ``eos_token_id``, else 0).
        max_batch_tokens: the most padded prompt tokens per batch; a longer prompt is continued alone.

    Returns:
        ``{"acc": [[float]*topk]*K, "positions": [int]*K, "prompts": int, "new_tokens": int, "topk": int,
        "target_ranks": [prompt][state][k] int}``: ``target_ranks`` holds, for every decoding state of every prompt
        (the position whose hidden state the heads read: the last prompt token, then each continuation token but the
        last two), the rank of each head's target or -1 (:func:`target_ranks`), what
        :func:`inference.tuning.replay.replayed_accept_length` replays a tree on.

    Raises:
        ValueError: no prompts, an empty prompt, or ``batch_size`` < 1.
    """
    if not prompts:
        raise ValueError("measure_head_accuracy needs at least one prompt")
    device = model.lm_head.weight.device
    K = model.heads.spec.num_heads
    hits = torch.zeros(K, min(topk, model.heads.spec.out_size), dtype=torch.long)
    totals = torch.zeros(K, dtype=torch.long)
    replay: list[list[list[int]]] = []
    new_tokens = 0
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
    stops = set() if eos_token_id is None else {eos_token_id}
    continuations: dict[int, list[int]] = {}
    for chunk in length_batches([len(p) for p in prompts], batch_size, max_tokens=max_batch_tokens):
        replies = greedy_generate(model.base, [list(prompts[i]) for i in chunk], max_new_tokens, pad, stops)
        continuations.update((i, tokens) for i, (tokens, _) in zip(chunk, replies))
    for i, prompt in enumerate(prompts):
        out = torch.tensor([list(prompt) + continuations[i]], device=device)
        new_tokens += out.shape[1] - len(prompt)
        heads = model(out, with_heads=True).head_logits  # [K, 1, T, V']
        valid = torch.zeros_like(out, dtype=torch.bool)
        valid[:, len(prompt) - 1 :] = True
        ranks = target_ranks(heads, to_head_vocab(out, model.heads.token_map, model.heads.spec.vocab_size), hits.shape[1])  # [K, 1, T]
        h, t = count_rank_hits(ranks, valid, hits.shape[1])
        hits += h
        totals += t
        # decoding states: the last prompt token .. the third-last token (each state's pass emits >= 1 token)
        states = ranks[:, 0, len(prompt) - 1 : out.shape[1] - 2]  # [K, N-1]
        replay.append(states.T.tolist())
    acc = (hits.double() / totals.clamp(min=1).unsqueeze(-1).double()).tolist()
    return {"acc": acc, "positions": totals.tolist(), "prompts": len(prompts), "new_tokens": new_tokens,
            "topk": hits.shape[1], "target_ranks": replay}
