"""Speculative decoding with a draft model, and the propose-verify loop every :class:`~inference.proposers.Proposer`
runs on (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al.
2023, "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2).

One step (:func:`speculative_step`, after gpt-fast ``generate.py:speculative_decode``): the proposer drafts, the
target reads the root, the proposal's auxiliary branch and its G candidates in ONE forward pass, the verifier
(:mod:`medusa_train.tree.acceptance`) keeps the longest accepted prefix plus the recovered or bonus token, and the KV
cache keeps only the root and the accepted tokens:

- a single chain with no auxiliary branch (the draft model) is an ordinary causal pass; the cache is cropped;
- anything else (Lookahead's window and G n-grams) gets a 4-D additive mask ``[1, 1, T, past + T]`` and explicit
  position ids (``past + offset``), as Medusa's tree pass does; the cache is compacted to the accepted positions
  (:func:`medusa_train.tree.kv_cache.keep_positions`).

Acceptance: greedy (temperature 0) keeps the longest candidate prefix equal to the target's argmax chain
(:func:`~medusa_train.tree.acceptance.greedy_accept`), so the output is exactly greedy decoding's. Sampling verifies one
chain with lossless speculative sampling (:func:`~medusa_train.tree.acceptance.chain_speculative_sample`): accept
drafted token x with min(1, p(x) / q(x)), on rejection resample from norm(max(0, p - q)), a bonus token from p when all
K are accepted. An empty proposal decodes one token exactly as plain decoding does.

Shapes: B batch (1), T tokens in a pass, G candidates, K drafted tokens, S auxiliary tokens, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from inference.decoders.base import (
    DecodeConfig,
    DecodeResult,
    check_context,
    choose_token,
    make_generator,
    prompt_tensor,
)
from inference.decoders.tree import tree_attention_mask
from inference.decoders.stopping import StopCondition
from inference.decoders.streaming import StreamFeed
from inference.draft_loading import check_draft_compatible, check_draft_length, check_schedule
from inference.proposers.base import Proposal, Proposer
from inference.proposers.draft_model import (
    DraftModelProposer,
    check_confidence_threshold,
    last_logits,
    takes_logits_to_keep,
)
from medusa_train.models.generation import max_positions
from medusa_train.tree.acceptance import chain_speculative_sample, greedy_accept
from medusa_train.tree.kv_cache import crop, keep_positions
from medusa_train.tree.sampling import logits_to_probs

# (prompt ids, sampling generator or None) -> the request's proposer
ProposerFactory = Callable[[list[int], "torch.Generator | None"], Proposer]


@dataclass(frozen=True)
class SpeculativeStep:
    """What one :func:`speculative_step` returns.

    Attributes:
        tokens: the accepted drafted tokens, then the recovered or bonus token (``accepted + 1`` tokens).
        accepted: drafted tokens kept.
        aux_logits: float ``[1 + R, V]``, the target's logits at the root and at the auxiliary tokens
            ``aux.logits_at`` (None without an auxiliary branch).
        cache_length: positions in the cache after the step (``past_length + 1 + accepted``).
    """

    tokens: list[int]
    accepted: int
    aux_logits: Tensor | None
    cache_length: int


def pass_layout(proposal: Proposal, device: torch.device) -> tuple[Tensor, Tensor]:
    """Who sees whom in a step's pass over ``[root, aux (S), G chains of K]`` (T = 1 + S + G K tokens), and where.

    Args:
        proposal: a non-empty or empty proposal, with or without an auxiliary branch.
        device: where the tensors go.

    Returns:
        ``(visible, offsets)``: bool ``[T, T]``, True where token i may attend to token j (every token sees the
        root; auxiliary tokens see each other as ``aux.mask`` says; a candidate sees its own chain up to itself;
        the branches never see each other); long ``[T]``, positions after the root (root 0, aux ``aux.offsets``,
        chain token k at k + 1).
    """
    g, k = (0, 0) if proposal.empty else tuple(proposal.tokens.shape)
    blocks = [torch.ones(1, 1, dtype=torch.bool, device=device)]
    offsets = [torch.zeros(1, dtype=torch.long, device=device)]
    if proposal.aux is not None:
        blocks.append(proposal.aux.mask.to(device))
        offsets.append(proposal.aux.offsets.to(device))
    chain = torch.ones(k, k, dtype=torch.bool, device=device).tril()
    blocks += [chain] * g
    offsets.append(torch.arange(1, k + 1, device=device).repeat(g))
    visible = torch.block_diag(*blocks)
    visible[:, 0] = True  # everything sees the root
    return visible, torch.cat(offsets)


def speculative_step(
    model: PreTrainedModel,
    cache: DynamicCache,
    root: int,
    past_length: int,
    proposal: Proposal,
    config: DecodeConfig,
    generator: torch.Generator | None,
    position_limit: int | None = None,
) -> SpeculativeStep:
    """One target pass over the root, the auxiliary branch and the candidates; verification; cache update.

    Args:
        model: the target ``*ForCausalLM``.
        cache: holds exactly ``past_length`` committed positions; updated in place.
        root: the last committed token (emitted, not yet in the cache).
        past_length: committed positions before the root.
        proposal: ``tokens [G, K]`` (``probs [G, K, V]`` or None), optional auxiliary branch.
        config: temperature / top-k / top-p of the request.
        generator: sampling generator (None when greedy).
        position_limit: the model's number of positions; positions past it are clamped (such tokens lie beyond
            ``max_new_tokens`` or in the auxiliary branch, and are never kept).

    Returns:
        :class:`SpeculativeStep`.

    Raises:
        ValueError: sampling (temperature > 0) with more than one candidate chain or an auxiliary branch.
    """
    device = model.get_output_embeddings().weight.device
    g, k = (0, 0) if proposal.empty else tuple(proposal.tokens.shape)
    drafts = proposal.tokens.to(device).reshape(g, k)
    aux = proposal.aux
    num_aux = 0 if aux is None else aux.tokens.numel()
    if not config.greedy and (g > 1 or aux is not None):
        raise ValueError(f"sampling verifies one drafted chain without an auxiliary branch; got G={g} candidates"
                         f"{' and an auxiliary branch' if aux is not None else ''} (use temperature=0)")
    parts = [torch.tensor([root], dtype=torch.long, device=device)]
    if aux is not None:
        parts.append(aux.tokens.to(device))
    parts.append(drafts.flatten())
    ids = torch.cat(parts).unsqueeze(0)  # [1, T]
    simple = aux is None and g <= 1
    if simple:  # one causal chain: the model's own mask and positions
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0]  # [1 + K, V]
    else:
        visible, offsets = pass_layout(proposal, device)
        positions = past_length + offsets
        if position_limit is not None:
            positions = positions.clamp(max=position_limit - 1)
        mask = tree_attention_mask(visible, past_length, model.dtype)  # [1, 1, T, past + T]
        # logits at the root, the auxiliary tokens asked for, and the candidates: [1 + R + G K, V]
        rows = torch.cat([torch.zeros(1, dtype=torch.long, device=device), 1 + aux.logits_at.to(device),
                          torch.arange(1 + num_aux, ids.shape[1], device=device)]) if aux is not None else None
        kwargs: dict[str, Any] = {}
        if rows is not None and takes_logits_to_keep(type(model)):
            kwargs["logits_to_keep"] = rows
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions.unsqueeze(0), cache=cache,
                       use_cache=True, **kwargs).logits[0]
        if rows is not None and "logits_to_keep" not in kwargs:
            logits = logits[rows]
    num_rows = 0 if aux is None else aux.logits_at.numel()  # auxiliary rows in `logits`

    draft_logits = logits[1 + num_rows :].view(g, k, logits.shape[-1])  # [G, K, V]
    best = 0
    if g == 0:
        accepted, next_token = 0, int(choose_token(logits[:1], config, generator)[0])
    elif config.greedy:
        candidates = torch.cat([drafts.new_full((g, 1), root), drafts], dim=1).unsqueeze(0)  # [1, G, K+1]
        at_paths = torch.cat([logits[:1].expand(g, 1, -1), draft_logits], dim=1).unsqueeze(0)  # [1, G, K+1, V]
        valid = torch.ones(g, k + 1, dtype=torch.bool, device=device)
        best_path, length, next_t = greedy_accept(candidates, at_paths, valid)
        best, accepted, next_token = int(best_path[0]), int(length[0]), int(next_t[0])
    else:
        target = logits_to_probs(torch.cat([logits[:1], draft_logits[0]]), config.temperature, config.top_k,
                                 config.top_p)  # [K+1, V]
        q = None if proposal.probs is None else proposal.probs[0].to(device)
        accepted, next_token = chain_speculative_sample(drafts[0], q, target, generator)

    if simple:
        crop(cache, past_length + 1 + accepted)
    else:
        start = 1 + num_aux + best * k
        keep = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(start, start + accepted)])
        keep_positions(cache, past_length, keep.to(device))
    return SpeculativeStep(
        tokens=(drafts[best, :accepted].tolist() if g else []) + [next_token],
        accepted=accepted,
        aux_logits=None if aux is None else logits[: 1 + num_rows],
        cache_length=past_length + 1 + accepted,
    )


def generate_with_proposer(
    model: PreTrainedModel,
    make_proposer: ProposerFactory,
    input_ids: Tensor | Sequence[int],
    config: DecodeConfig,
    streamer: Any = None,
    tokenizer: Any = None,
    extra_limits: Sequence[tuple[int | None, str]] = (),
    full_attention_cache: bool = False,
) -> DecodeResult:
    """Decode one reply by proposing and verifying (see the module docstring); counts as
    :mod:`inference.decoders.base` defines them (prefill apart, one decoding pass per :func:`speculative_step`).

    Args:
        model: the target.
        make_proposer: builds the request's proposer from the prompt ids and the sampling generator.
        input_ids, config, streamer: as :meth:`~inference.decoders.base.Decoder.generate`.
        tokenizer: for ``stop_strings`` and ``text``.
        extra_limits: further ``(positions, what)`` context limits to check (e.g. the draft model's).
        full_attention_cache: build a plain ``DynamicCache()`` (full-attention layers, compactable) instead of one
            from the model's config.

    Raises:
        ValueError: as the decoders' ``generate``.
    """
    device = model.get_output_embeddings().weight.device
    prompt = prompt_tensor(input_ids, device)
    limit = max_positions(model.config)
    check_context(prompt.shape[1], config.max_new_tokens, limit)
    for other, what in extra_limits:
        check_context(prompt.shape[1], config.max_new_tokens, other, what)
    stop = StopCondition(config, tokenizer)
    feed = StreamFeed(streamer)
    generator = None if config.greedy else make_generator(config, device)

    start = time.perf_counter()
    feed.start(prompt)
    sequence = prompt[0].tolist()
    proposer = make_proposer(list(sequence), generator)
    cache = DynamicCache() if full_attention_cache else DynamicCache(config=model.config)
    root = int(choose_token(last_logits(model, prompt, cache).unsqueeze(0), config, generator)[0])
    tokens, reason = stop.cut([], [root])
    prefill_time = time.perf_counter() - start
    feed.put(tokens)
    sequence.append(root)
    past_length = prompt.shape[1]
    accepted: list[int] = []
    while reason is None:
        room = config.max_new_tokens - len(tokens)
        proposal = proposer.propose(sequence, room - 1)
        step = speculative_step(model, cache, sequence[-1], past_length, proposal, config, generator, limit)
        kept, reason = stop.cut(tokens, step.tokens)
        tokens += kept
        accepted.append(len(kept))
        feed.put(kept)
        sequence += step.tokens
        past_length = step.cache_length
        if reason is None:
            proposer.update(sequence, step.accepted, step.aux_logits)
    feed.end()
    return DecodeResult(
        tokens=tokens,
        accepted_lengths=accepted,
        forward_passes=len(accepted),
        wall_time_s=time.perf_counter() - start,
        prefill_time_s=prefill_time,
        stop_reason=reason,
        prompt_tokens=prompt.shape[1],
        text=None if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True),
    )


class DraftDecoder:
    """Speculative decoding with a draft model (see the module docstring).

    Args:
        model: the target ``*ForCausalLM`` (a :class:`~medusa_train.models.speculative.SpeculativeModel` is accepted: its base is
            used).
        draft: a ``*ForCausalLM`` with the target's vocabulary: a smaller sibling, or the target's own first layers
            (:func:`inference.draft_loading.self_layer_draft`).
        num_draft_tokens: K >= 1, tokens drafted per step (the first K with ``schedule="heuristic"``).
        schedule: ``constant`` or ``heuristic`` (K + 2 after a fully accepted step, else max(1, K - 1)).
        tokenizer: the target's; needed for ``stop_strings`` and ``text``, and compared with ``draft_tokenizer``.
        draft_tokenizer: the draft's, when it is a separate model.
        confidence_threshold: in [0, 1): the draft stops early after a token it gave less probability than this
            (transformers' ``assistant_confidence_threshold``, whose default is 0.4); 0 always drafts K tokens.

    Raises:
        ValueError: K < 1, an unknown schedule, a threshold outside [0, 1), a draft with another vocabulary or on
            another device (the message names the field).
        TypeError: ``model`` or ``draft`` is not a transformers ``*ForCausalLM``.
    """

    name = "draft"

    def __init__(
        self,
        model: Any,
        draft: Any,
        num_draft_tokens: int = 5,
        schedule: str = "constant",
        tokenizer: Any = None,
        draft_tokenizer: Any = None,
        confidence_threshold: float = 0.0,
    ) -> None:
        base = getattr(model, "base", model)
        for what, value in (("model", base), ("draft", draft)):
            if not isinstance(value, PreTrainedModel):
                raise TypeError(f"DraftDecoder needs a transformers *ForCausalLM as {what}, got {type(value).__name__}")
        self.num_draft_tokens = check_draft_length(num_draft_tokens)
        check_schedule(schedule)
        self.confidence_threshold = check_confidence_threshold(confidence_threshold)
        check_draft_compatible(base, draft, tokenizer, draft_tokenizer)
        devices = (base.get_output_embeddings().weight.device, draft.get_output_embeddings().weight.device)
        if devices[0] != devices[1]:
            raise ValueError(f"draft is on {devices[1]} but the target on {devices[0]}: put both on one device")
        self.model = base
        self.draft = draft
        self.schedule = schedule
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode one reply (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: empty prompt, batch > 1, prompt + ``max_new_tokens`` beyond the target's or the draft's
                context, or ``stop_strings`` without a tokenizer.
        """
        def make(prompt: list[int], generator: torch.Generator | None) -> Proposer:
            return DraftModelProposer(self.draft, config, generator, self.num_draft_tokens, self.schedule,
                                      self.confidence_threshold)

        return generate_with_proposer(
            self.model, make, input_ids, config, streamer, self.tokenizer,
            extra_limits=[(max_positions(self.draft.config), "the draft model's context")],
        )


__all__ = ["DraftDecoder", "SpeculativeStep", "generate_with_proposer", "pass_layout", "speculative_step"]
