"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding",
ICML 2024): no draft model; every step is ONE target pass over

- the **lookahead branch**: a 2-D window of N - 1 levels x W tokens on which the pass performs one Jacobi iteration,
  whose trajectories yield n-grams for the pool (Sec. 3.1), and
- the **verification branch**: up to G n-grams from the pool whose first token is the root (Sec. 3.2),

with the combined attention mask (Sec. 3.3, Fig. 2b: the branches cannot see each other; each token sees the
committed sequence, the root and its own predecessors), explicit position ids on top of the KV cache, greedy
verification through :mod:`medusa_train.tree.acceptance`, and KV compaction keeping only the accepted verification
tokens. The pool is updated after every pass. Greedy and lossless: the output is exactly greedy decoding's.

The drafter is :class:`~inference.proposers.lookahead.LookaheadProposer`; the pass and the verification are
:func:`inference.decoders.draft.speculative_step`. Cost per pass: (N - 1) W + G (N - 1) tokens (the root is the
window's first token), the lm_head on 1 + W + G (N - 1) of them (the root, the window's top level, the candidates).

Shapes: W window, N n-gram size, G guesses, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from inference.decoders.base import DecodeConfig, DecodeResult
from inference.decoders.draft import generate_with_proposer
from inference.proposers.base import Proposer
from inference.proposers.lookahead import LookaheadProposer, check_lookahead_settings

_CUSTOM_MASK_FREE = ("flash_attention_2", "flash_attention_3", "flex_attention")


def check_custom_mask_support(model: PreTrainedModel) -> None:
    """Raise ``NotImplementedError`` unless every layer takes one custom 4-D mask (full attention, sdpa/eager).

    Raises:
        NotImplementedError: a flash-attention backend, or sliding-window / hybrid layers.
    """
    config = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn in _CUSTOM_MASK_FREE:
        raise NotImplementedError(f"attn_implementation={attn!r} cannot take Lookahead's custom 4-D mask; load the "
                                  "model with attn_implementation='sdpa' or 'eager'")
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if kinds or window:
        raise NotImplementedError(
            f"Lookahead passes one custom mask to every layer and cannot reproduce sliding windows "
            f"(layer types {sorted(kinds) or ['full_attention']}, sliding_window={window}); use the vanilla decoder"
        )


class LookaheadDecoder:
    """Lookahead decoding, greedy (see the module docstring).

    Args:
        model: the target ``*ForCausalLM`` (a :class:`~medusa_train.models.speculative.SpeculativeModel` is accepted: its base is
            used).
        window: W >= 1, positions ahead per Jacobi iteration.
        ngram: N >= 2, n-gram size (N - 1 window levels; N - 1 tokens verified per candidate).
        guesses: G >= 1, candidates verified per step (and continuations kept per pool key).
        prompt_ngrams: also fill the pool with the prompt's and the reply's own n-grams (LADE's
            ``POOL_FROM_PROMPT``; helps prompts whose answer repeats them, e.g. code).
        initial_ngrams: n-grams (N tokens each) put in every request's pool first.
        tokenizer: optional; needed for ``stop_strings`` and to fill :attr:`DecodeResult.text`.

    Raises:
        ValueError: W, N or G out of range (the message names the field), or an initial n-gram of another length.
        NotImplementedError: an attention layout that cannot take a custom 4-D mask.
        TypeError: ``model`` is not a transformers ``*ForCausalLM``.
    """

    name = "lookahead"

    def __init__(
        self,
        model: Any,
        window: int = 5,
        ngram: int = 4,
        guesses: int = 5,
        prompt_ngrams: bool = True,
        initial_ngrams: Iterable[Sequence[int]] = (),
        tokenizer: Any = None,
    ) -> None:
        check_lookahead_settings(window, ngram, guesses)
        base = getattr(model, "base", model)
        if not isinstance(base, PreTrainedModel):
            raise TypeError(f"LookaheadDecoder needs a transformers *ForCausalLM, got {type(model).__name__}")
        check_custom_mask_support(base)
        self.initial_ngrams = [tuple(int(t) for t in gram) for gram in initial_ngrams]
        for gram in self.initial_ngrams:
            if len(gram) != ngram:
                raise ValueError(f"initial_ngrams must hold N={ngram} tokens each, got {list(gram)}")
        self.model = base
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.prompt_ngrams = prompt_ngrams
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode one reply (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: temperature > 0 (Lookahead here is greedy), empty prompt, batch > 1, prompt +
                ``max_new_tokens`` beyond the model's context, or ``stop_strings`` without a tokenizer.
        """
        if not config.greedy:
            raise ValueError(f"LookaheadDecoder decodes greedily: set temperature=0 (got {config.temperature})")
        device = self.model.get_output_embeddings().weight.device

        def make(prompt: list[int], generator: torch.Generator | None) -> Proposer:
            return LookaheadProposer(prompt, self.window, self.ngram, self.guesses, self.prompt_ngrams,
                                     self.initial_ngrams, device)

        return generate_with_proposer(self.model, make, input_ids, config, streamer, self.tokenizer,
                                      full_attention_cache=True)


__all__ = ["LookaheadDecoder", "check_custom_mask_support"]
