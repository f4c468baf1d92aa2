"""The Hugging Face peers in our harness: what users would run instead of our decoders, reporting the same
:class:`~inference.decoders.base.DecodeResult`.

- :class:`HfAssistedDecoder` (``hf_assisted``): ``model.generate(assistant_model=draft, do_sample=False)``,
  transformers' assisted generation (Leviathan et al. 2023 with greedy verification).
- :class:`HfPromptLookupDecoder` (``hf_prompt_lookup``): ``model.generate(prompt_lookup_num_tokens=...)``, prompt
  lookup decoding (Saxena 2023): drafts copied from the prompt after a matching n-gram.

What is measured, and how (transformers 5.24 ``generation/utils.py:_assisted_decoding``):

- **tokens, wall time**: exact: the ``generate`` call, prefill included, timed around it; the reply is cut by our
  :class:`~inference.decoders.stopping.StopCondition` (EOS kept, ``max_new_tokens``, stop strings) exactly as our
  decoders cut theirs.
- **forward passes**: exact: a forward pre-hook on the target model (registered for the call only, then removed)
  counts its calls; the draft's calls are not counted (it is another module). ``forward_passes`` is the count
  minus the first (prefill) call.
- **accepted lengths**: derived, since ``generate`` does not expose per-step data: the hook also reads the KV-cache
  length at the start of every target call. After every call HF crops the cache to the committed sequence minus
  its last token, so call i >= 1 starts from ``c_i = committed_i - 1`` and the tokens call i emitted are
  ``committed_{i+1} - committed_i``. HF verifies its first draft *inside the prefill call*; those extra accepted
  tokens are credited to the first decoding pass, so that ``len(tokens) == 1 + sum(accepted_lengths)`` and
  ``mean_accepted_tokens == (len(tokens) - 1) / forward_passes``, the formula our decoders follow. When the reply
  ends within the prefill call there is no decoding pass and the tokens after the first are credited to none.
- **prefill time**: from the start of ``generate`` to the end of the first target call (for ``hf_assisted`` it
  includes drafting the first candidates).

Greedy only (temperature must be 0), as ``do_sample=False`` in the benchmark contract. Streaming: a Hugging Face
``BaseStreamer`` is handed to ``generate``; one of our :class:`~inference.decoders.base.TokenStreamer` is adapted.
Either receives what ``generate`` emits, which with ``stop_strings`` may run a few tokens past our cut.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from inference.decoders.base import DecodeConfig, DecodeResult, check_context, prompt_tensor
from inference.decoders.stopping import MAX_NEW_TOKENS, StopCondition
from inference.draft_loading import check_draft_compatible, check_draft_length, check_schedule
from medusa_train.models.generation import max_positions

# our schedule -> transformers' num_assistant_tokens_schedule ("heuristic_transient": reset for every call, as ours)
_HF_SCHEDULES = {"constant": "constant", "heuristic": "heuristic_transient"}


class TargetPasses:
    """What a forward pre-hook and hook saw of the target's calls: KV-cache length at each call's start, and the
    time the first call ended."""

    def __init__(self) -> None:
        self.cache_lengths: list[int] = []
        self.first_end: float | None = None

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.cache_lengths.append(0 if cache is None else int(cache.get_seq_length()))

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.first_end is None:
            self.first_end = time.perf_counter()


@contextmanager
def record_target_passes(model: nn.Module) -> Iterator[TargetPasses]:
    """Count ``model``'s forward calls while the block runs (hooks removed on exit, even on error)."""
    record = TargetPasses()
    handles = [model.register_forward_pre_hook(record._before, with_kwargs=True),
               model.register_forward_hook(record._after, with_kwargs=True)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def emitted_per_pass(prompt_tokens: int, cache_lengths: Sequence[int], new_tokens: int) -> list[int]:
    """Tokens each target call emitted, from the cache lengths at the calls' starts (see the module docstring).

    Args:
        prompt_tokens: T.
        cache_lengths: KV-cache length at the start of each call (the first is the prefill, 0).
        new_tokens: tokens ``generate`` returned after the prompt.

    Returns:
        one count per call; they sum to ``new_tokens``.
    """
    committed = [prompt_tokens] + [c + 1 for c in cache_lengths[1:]] + [prompt_tokens + new_tokens]
    return [b - a for a, b in zip(committed, committed[1:])]


def accepted_lengths_from_passes(emitted: Sequence[int], kept: int) -> list[int]:
    """Per decoding pass (prefill excluded) tokens kept, the prefill's extra tokens credited to the first pass, cut
    so that they sum to ``kept - 1`` (the reply may have been cut after ``generate``)."""
    lengths = list(emitted[1:])
    if lengths:
        lengths[0] += emitted[0] - 1
    room = max(kept - 1, 0)
    out: list[int] = []
    for n in lengths:
        if room <= 0:
            break
        out.append(min(n, room))
        room -= out[-1]
    return out


class _TokenStreamerAdapter(BaseStreamer):
    """Drives one of our ``put(list[int])``/``end()`` streamers from ``generate`` (which first puts the prompt)."""

    def __init__(self, streamer: Any) -> None:
        self.streamer = streamer
        self.prompt_seen = False

    def put(self, value: Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.streamer.put(value.reshape(-1).tolist())

    def end(self) -> None:
        self.streamer.end()


def _hf_streamer(streamer: Any) -> BaseStreamer | None:
    if streamer is None or isinstance(streamer, BaseStreamer):
        return streamer
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer must have put() and end() methods, got {type(streamer).__name__}")
    return _TokenStreamerAdapter(streamer)


@contextmanager
def _generation_settings(model: PreTrainedModel, **values: Any) -> Iterator[None]:
    """Swap in a copy of ``model.generation_config`` with ``values`` set for the block; restore it on exit."""
    saved = model.generation_config
    patched = copy.deepcopy(saved)
    for key, value in values.items():
        setattr(patched, key, value)
    model.generation_config = patched
    try:
        yield
    finally:
        model.generation_config = saved


def _target(model: Any, who: str) -> PreTrainedModel:
    base = getattr(model, "base", model)
    if not isinstance(base, PreTrainedModel):
        raise TypeError(f"{who} needs a transformers *ForCausalLM, got {type(model).__name__}")
    return base


def hf_generate(
    model: PreTrainedModel,
    input_ids: Tensor | Sequence[int],
    config: DecodeConfig,
    streamer: Any,
    tokenizer: Any,
    who: str,
    **generate_kwargs: Any,
) -> DecodeResult:
    """Run ``model.generate`` greedily with ``generate_kwargs`` and measure it (see the module docstring).

    Raises:
        ValueError: temperature > 0, empty prompt, batch > 1, prompt + ``max_new_tokens`` beyond the context,
            ``stop_strings`` without a tokenizer.
    """
    if not config.greedy:
        raise ValueError(f"{who} runs generate(do_sample=False): set temperature=0 (got {config.temperature})")
    device = model.get_output_embeddings().weight.device
    prompt = prompt_tensor(input_ids, device)
    check_context(prompt.shape[1], config.max_new_tokens, max_positions(model.config))
    stop = StopCondition(config, tokenizer)
    eos = list(config.eos_token_ids)
    pad = eos[0] if eos else (model.generation_config.pad_token_id or 0)
    kwargs: dict[str, Any] = dict(
        attention_mask=torch.ones_like(prompt), max_new_tokens=config.max_new_tokens, do_sample=False,
        eos_token_id=eos, pad_token_id=pad, streamer=_hf_streamer(streamer), **generate_kwargs,
    )
    if config.stop_strings:
        kwargs.update(stop_strings=list(config.stop_strings), tokenizer=tokenizer)

    start = time.perf_counter()
    with record_target_passes(model) as passes:
        output = model.generate(prompt, **kwargs)
    wall = time.perf_counter() - start
    new = output[0, prompt.shape[1]:].tolist()
    tokens, reason = stop.cut([], new)
    emitted = emitted_per_pass(prompt.shape[1], passes.cache_lengths, len(new))
    accepted = accepted_lengths_from_passes(emitted, len(tokens))
    return DecodeResult(
        tokens=tokens,
        accepted_lengths=accepted,
        forward_passes=len(accepted),
        wall_time_s=wall,
        prefill_time_s=(passes.first_end or start) - start,
        stop_reason=reason or MAX_NEW_TOKENS,  # generate stops only on the criteria it was given (ours)
        prompt_tokens=prompt.shape[1],
        text=None if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True),
    )


class HfAssistedDecoder:
    """``model.generate(assistant_model=draft, do_sample=False)`` behind our interface (see the module docstring).

    Args:
        model: the target ``*ForCausalLM``.
        draft: the assistant, with the target's vocabulary (e.g. :func:`inference.draft_loading.self_layer_draft`).
        num_draft_tokens: K >= 1, transformers' ``num_assistant_tokens``.
        schedule: ``constant`` or ``heuristic`` (transformers' ``heuristic_transient``: K + 2 / K - 1, reset every
            call, as our draft decoder).
        confidence_threshold: transformers' ``assistant_confidence_threshold`` (the draft stops early below this
            probability); None keeps the draft's generation config value (transformers' default 0.4), 0 turns it
            off so that exactly K tokens are drafted, as our draft decoder does.
        tokenizer: the target's; needed for ``stop_strings`` and ``text``.
        draft_tokenizer: the draft's, compared with ``tokenizer`` when given.

    The settings are put on a copy of the draft's ``generation_config`` for the duration of each call only.

    Raises:
        ValueError: K < 1, an unknown schedule, a draft with another vocabulary, or the target object as its own draft.
        TypeError: a model that is not a transformers ``*ForCausalLM``.
    """

    name = "hf_assisted"

    def __init__(
        self,
        model: Any,
        draft: Any,
        num_draft_tokens: int = 5,
        schedule: str = "constant",
        confidence_threshold: float | None = None,
        tokenizer: Any = None,
        draft_tokenizer: Any = None,
    ) -> None:
        self.model = _target(model, "HfAssistedDecoder")
        self.draft = _target(draft, "HfAssistedDecoder (draft)")
        if self.draft is self.model:
            raise ValueError("draft is the target model object itself: hf_assisted counts the target's forward calls "
                             "with a hook, which would count the draft's too; pass a separate module (e.g. "
                             "copy.deepcopy(model))")
        self.num_draft_tokens = check_draft_length(num_draft_tokens)
        check_schedule(schedule)
        check_draft_compatible(self.model, self.draft, tokenizer, draft_tokenizer)
        self.schedule = schedule
        self.confidence_threshold = confidence_threshold
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode one reply (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: as :func:`hf_generate`.
        """
        settings: dict[str, Any] = dict(num_assistant_tokens=self.num_draft_tokens,
                                        num_assistant_tokens_schedule=_HF_SCHEDULES[self.schedule])
        if self.confidence_threshold is not None:
            settings["assistant_confidence_threshold"] = self.confidence_threshold
        with _generation_settings(self.draft, **settings):
            return hf_generate(self.model, input_ids, config, streamer, self.tokenizer, "hf_assisted",
                               assistant_model=self.draft)


class HfPromptLookupDecoder:
    """``model.generate(prompt_lookup_num_tokens=..., do_sample=False)`` behind our interface.

    Args:
        model: the target ``*ForCausalLM``.
        num_draft_tokens: K >= 1, transformers' ``prompt_lookup_num_tokens`` (tokens copied per match).
        max_matching_ngram_size: longest n-gram matched against the prompt (transformers' default 2), >= 1.
        tokenizer: optional; needed for ``stop_strings`` and ``text``.

    Raises:
        ValueError: K or ``max_matching_ngram_size`` below 1 (the message names it).
        TypeError: a model that is not a transformers ``*ForCausalLM``.
    """

    name = "hf_prompt_lookup"

    def __init__(
        self, model: Any, num_draft_tokens: int = 10, max_matching_ngram_size: int = 2, tokenizer: Any = None
    ) -> None:
        self.model = _target(model, "HfPromptLookupDecoder")
        self.num_draft_tokens = check_draft_length(num_draft_tokens, "num_draft_tokens (prompt_lookup_num_tokens)")
        if isinstance(max_matching_ngram_size, bool) or not isinstance(max_matching_ngram_size, int) \
                or max_matching_ngram_size < 1:
            raise ValueError(f"max_matching_ngram_size must be an int >= 1, got {max_matching_ngram_size!r}")
        self.max_matching_ngram_size = max_matching_ngram_size
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode one reply (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: as :func:`hf_generate`.
        """
        return hf_generate(self.model, input_ids, config, streamer, self.tokenizer, "hf_prompt_lookup",
                           prompt_lookup_num_tokens=self.num_draft_tokens,
                           max_matching_ngram_size=self.max_matching_ngram_size)


__all__ = [
    "HfAssistedDecoder",
    "HfPromptLookupDecoder",
    "TargetPasses",
    "accepted_lengths_from_passes",
    "emitted_per_pass",
    "hf_generate",
    "record_target_passes",
]
