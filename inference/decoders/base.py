"""What every decoder shares: the request (:class:`DecodeConfig`, which lives in :mod:`inference.decode_config`, below
the decoders and the proposers alike), the record (:class:`DecodeResult`), the :class:`Decoder` protocol, and the checks
and token choice each decoder runs before and during decoding.

Counting convention (mean accepted tokens τ as Spec-Bench reports it, Xia et al. 2024, "Unlocking Efficiency in
Large Language Model Inference: A Comprehensive Survey of Speculative Decoding"):

- The **prefill** pass reads the prompt and produces the first new token. It is counted apart
  (``prefill_passes``, always 1) and its token is not part of ``accepted_lengths``.
- Every later target-model forward pass is a **decoding pass** (``forward_passes``). It emits at least one token:
  the drafted tokens it accepted plus the recovered or bonus token. ``accepted_lengths[i]`` is the number of tokens
  decoding pass ``i`` emitted and that were kept (the last pass can be cut by EOS, a stop string or
  ``max_new_tokens``).
- Hence ``len(tokens) == 1 + sum(accepted_lengths)`` and ``len(accepted_lengths) == forward_passes``, and
  ``mean_accepted_tokens = (len(tokens) - 1) / forward_passes``: exactly 1.0 for plain decoding and exactly
  ``D + 1`` for a tree of depth D whose every path is accepted.

Shapes: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from inference.decode_config import DecodeConfig
from medusa_train.tree.sampling import greedy_tokens, logits_to_probs


@dataclass
class DecodeResult:
    """What one :meth:`Decoder.generate` call produced, with the counts speed comparisons need.

    Attributes:
        tokens: the new token ids (prompt excluded), EOS included when it ended the reply.
        accepted_lengths: tokens kept from each decoding pass (prefill excluded; see the module docstring).
        forward_passes: target-model forward passes after the prefill (= ``len(accepted_lengths)``).
        prefill_passes: target-model passes over the prompt (1).
        wall_time_s: seconds for the whole call, prefill included.
        prefill_time_s: seconds of the prefill (prompt pass and first token).
        stop_reason: ``"eos"``, ``"stop_string"`` or ``"max_new_tokens"``.
        prompt_tokens: T, the prompt length.
        text: the decoded reply when the decoder has a tokenizer, else None.
        top2_gaps: when the decoder records them (plain decoding, ``record_top2_gaps``): for each token, the gap
            between the largest and second-largest logit it was chosen from (logit units; computed after the clock
            stopped). What a divergence of another decoder from this reply is measured against.
        draft_time_s: tree decoders: seconds spent drafting (the heads filling the tree), summed over the
            decoding passes; None for decoders that do not time it (:mod:`inference.decoders.timing`).
        verify_time_s: tree decoders: seconds of the rest of each step (tree pass, acceptance, cache compaction),
            summed; None likewise. Batched decoding reports the whole batch's, as ``wall_time_s``.
    """

    tokens: list[int]
    accepted_lengths: list[int]
    forward_passes: int
    wall_time_s: float
    prefill_time_s: float
    stop_reason: str
    prompt_tokens: int
    prefill_passes: int = 1
    text: str | None = None
    top2_gaps: list[float] | None = None
    draft_time_s: float | None = None
    verify_time_s: float | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def mean_accepted_tokens(self) -> float:
        """τ = tokens emitted by decoding passes / decoding passes = ``(len(tokens) - 1) / forward_passes``.

        Plain decoding scores exactly 1.0. NaN when there was no decoding pass (the prefill's token ended the
        reply); to aggregate over prompts, divide the sums instead (:func:`aggregate_mean_accepted_tokens`).
        """
        if self.forward_passes == 0:
            return math.nan
        return sum(self.accepted_lengths) / self.forward_passes

    @property
    def tokens_per_second(self) -> float:
        """New tokens / wall time (prefill included), 0.0 for a zero-length timing."""
        return len(self.tokens) / self.wall_time_s if self.wall_time_s > 0 else 0.0


def aggregate_mean_accepted_tokens(results: Sequence[DecodeResult]) -> float:
    """τ over several replies: all decoding-pass tokens / all decoding passes (NaN when there were none)."""
    passes = sum(r.forward_passes for r in results)
    return sum(sum(r.accepted_lengths) for r in results) / passes if passes else math.nan


@runtime_checkable
class TokenStreamer(Protocol):
    """Receives the reply as it is decided: ``put`` with each step's kept new token ids, then ``end`` once.

    Decoders also accept a Hugging Face ``BaseStreamer`` (e.g. ``TextStreamer``); it is driven exactly as
    ``model.generate`` drives it (see :mod:`inference.decoders.streaming`).
    """

    def put(self, token_ids: list[int]) -> None: ...

    def end(self) -> None: ...


class Decoder(Protocol):
    """A text generator with one interface for every method (plain, Medusa, draft model, lookahead, ...).

    Decoders that can decode several prompts at once also offer
    ``generate_batch(prompts: Sequence[Tensor | Sequence[int]], config) -> list[DecodeResult]`` (not part of the
    protocol).

    Attributes:
        name: the decoder's name in results and summaries (``vanilla``, ``medusa``, ...).
    """

    name: str

    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode a reply to one prompt.

        Args:
            input_ids: long ``[1, T]`` or ``[T]`` tensor, or a list of T ints; T >= 1.
            config: the request.
            streamer: a :class:`TokenStreamer`, a Hugging Face ``BaseStreamer``, or None.

        Raises:
            ValueError: empty prompt, batch > 1, or ``T + max_new_tokens`` beyond the model's context.
        """
        ...


def prompt_tensor(input_ids: Tensor | Sequence[int], device: torch.device) -> Tensor:
    """Check a single prompt and return it as long ``[1, T]`` on ``device``.

    Raises:
        ValueError: the prompt is empty, has a batch of more than one row, or is not integer ids.
    """
    ids = input_ids if isinstance(input_ids, Tensor) else torch.tensor(list(input_ids), dtype=torch.long)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if ids.ndim != 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"input_ids must be integer ids [1, T] or [T], got {ids.dtype} {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise ValueError(f"input_ids has batch {ids.shape[0]}; decoders take one prompt at a time ([1, T])")
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token (e.g. BOS)")
    return ids.to(device=device, dtype=torch.long)


def check_context(
    prompt_len: int, max_new_tokens: int, limit: int | None, what: str = "the model's context", reserve: int = 0
) -> None:
    """Raise ``ValueError`` naming ``max_new_tokens`` when ``prompt_len + max_new_tokens + reserve > limit``.

    ``reserve``: positions a decoder needs beyond the reply (e.g. a draft tree's depth); ``limit`` None: no check.
    """
    if limit is None or prompt_len + max_new_tokens + reserve <= limit:
        return
    extra = f" + {reserve} reserved" if reserve else ""
    room = limit - prompt_len - reserve
    fix = (f"lower max_new_tokens to at most {room} or shorten the prompt" if room >= 1 else
           f"the prompt alone leaves no room for a reply: shorten it to fewer than {limit - reserve} tokens or leave "
           "it out")
    raise ValueError(
        f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}){extra} = "
        f"{prompt_len + max_new_tokens + reserve} exceeds {what} ({limit} positions); {fix}"
    )


def make_generator(config: DecodeConfig, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``config.seed`` (a fresh random seed when None)."""
    generator = torch.Generator(device=device)
    if config.seed is None:
        generator.seed()
    else:
        generator.manual_seed(config.seed)
    return generator


def choose_token(logits: Tensor, config: DecodeConfig, generator: torch.Generator | None) -> Tensor:
    """The next token from logits: argmax when greedy, else a draw from the warped distribution.

    Args:
        logits: float ``[B, V]``.
        config: temperature, top-k, top-p (see :func:`medusa_train.tree.sampling.logits_to_probs`).
        generator: the sampling generator (unused when greedy).

    Returns:
        long ``[B]``.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    if config.greedy:
        return greedy_tokens(logits)
    probs = logits_to_probs(logits, config.temperature, config.top_k, config.top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


__all__ = [
    "DecodeConfig",
    "DecodeResult",
    "Decoder",
    "TokenStreamer",
    "aggregate_mean_accepted_tokens",
    "check_context",
    "choose_token",
    "make_generator",
    "prompt_tensor",
]
