"""Run several decoders over a prompt set, interleaved, resumably.

- **Interleaved**: for each prompt and turn every decoder runs in turn (the baseline first), so slow drifts of the
  machine (thermal throttling, other load) hit all decoders alike instead of whichever ran last.
- **Warm-up**: each decoder generates ``warmup`` short untimed replies first (allocator, kernels, caches).
- **Multi-turn**: turn n's prompt is the conversation so far, where the assistant's earlier answers are the
  **baseline's** answers (``vanilla``, greedy when ``temperature == 0``). Every decoder thus sees the same prompt
  on every turn, so their timings and outputs compare like for like; with greedy lossless decoders it is also each
  decoder's own answer. (MT-Bench's protocol answers the second question after the model's own first answer.)
- **Resumable**: each (prompt, turn, decoder) row is appended to ``results.jsonl`` as soon as it is measured and
  skipped when the run restarts; the baseline's stored text gives later turns the same conversation again.
- **Prompts that do not fit**: a prompt turn whose tokens plus ``max_new_tokens`` exceed the target's context is
  skipped, with its later turns, before any decoder runs on it: every first turn is checked before the first
  decoder runs (all of them named in one warning), a later turn when the conversation reaching it is known. The
  skipped turns are returned (``summary.json`` lists them) with the ``max_new_tokens`` that would fit them. A run
  where no prompt fits (none measured before either) fails before any decoder runs (:class:`NothingFits`), rather
  than end with an empty table.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from inference.decoders.base import DecodeConfig, Decoder
from inference.evaluation.eval_config import BASELINE
from inference.evaluation.results import ResultsLog, make_row
from medusa_train.chat.prompts import Prompt, encode_prompt

log = logging.getLogger(__name__)


@dataclass
class PromptRun:
    """What :func:`evaluate_prompts` did.

    Attributes:
        rows: the rows of this prompt set in run order (prompt, turn, decoder), resumed and new alike.
        skipped: one record per prompt turn left out because it does not fit the context (its later turns go with
            it): ``{"prompt_id", "turn", "prompt_tokens", "max_new_tokens", "context", "fits_max_new_tokens"}``,
            the last None when the prompt alone fills the context.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)


def overlong(prompt_id: str, turn: int, prompt_tokens: int, max_new_tokens: int,
             context: int | None) -> dict[str, Any] | None:
    """The skip record of a prompt turn that does not fit ``context`` positions with ``max_new_tokens`` (None when
    it fits, or when the context is unknown)."""
    if context is None or prompt_tokens + max_new_tokens <= context:
        return None
    room = context - prompt_tokens
    return {"prompt_id": prompt_id, "turn": turn, "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens,
            "context": context, "fits_max_new_tokens": room if room >= 1 else None}


def context_limits(decoders: Mapping[str, Decoder], context: int | None) -> dict[str, int]:
    """Each known limit on the positions of one sequence, by the setting that sets it: ``max_position_embeddings``
    (``context``, the target's) and ``decoder.<name>.max_model_len`` (an engine such as vLLM reserves less than the
    model allows)."""
    limits = {} if context is None else {"max_position_embeddings": context}
    for name, decoder in decoders.items():
        if getattr(decoder, "max_model_len", None) is not None:
            limits[f"decoder.{name}.max_model_len"] = decoder.max_model_len
    return limits


def decoders_context(decoders: Mapping[str, Decoder], context: int | None) -> int | None:
    """The positions every decoder can use: the smallest of :func:`context_limits`; None when none is known."""
    limits = context_limits(decoders, context)
    return min(limits.values()) if limits else None


class NothingFits(ValueError):
    """Every prompt of the run was left out because it does not fit the context: the run would measure nothing."""


def nothing_fits(skipped: Sequence[dict[str, Any]], limits: Mapping[str, int], max_new_tokens: int) -> NothingFits:
    """The error of a run whose every prompt was ``skipped`` (:func:`overlong`'s records): each named with its length,
    the setting that set the context (``limits``: :func:`context_limits`) and the fixes."""
    context = min(limits.values())
    binding = [name for name, value in limits.items() if value == context]
    fixes = []
    fits = sorted(s["fits_max_new_tokens"] for s in skipped if s["fits_max_new_tokens"])
    if fits:
        fixes.append(f"lower max_new_tokens (max_new_tokens={fits[0]} fits {len(fits)} of them)")
    engines = [name for name in binding if name.endswith(".max_model_len")]
    if engines:
        most = limits.get("max_position_embeddings")
        fixes.append(f"raise {' and '.join(engines)}" + (f" (the target allows {most} positions)" if most else ""))
    fixes.append("give shorter prompts" if engines else "give shorter prompts or a target with a longer context")
    setting = ", ".join(f"{name}={limits[name]}" for name in binding)
    return NothingFits(f"no prompt fits the context of {context} positions ({setting}) with max_new_tokens="
                       f"{max_new_tokens}, so the run would measure nothing; all {len(skipped)} left out: "
                       f"{describe_skips(skipped)}. To measure them: {'; or '.join(fixes)}")


def describe_skips(skipped: Sequence[dict[str, Any]]) -> str:
    """One line naming every skipped prompt turn, its length and what would fit it."""
    parts = []
    for s in skipped:
        fix = (f"max_new_tokens={s['fits_max_new_tokens']} would fit it" if s["fits_max_new_tokens"] else
               "the prompt alone fills the context: leave it out")
        parts.append(f"prompt {s['prompt_id']!r} turn {s['turn']} ({s['prompt_tokens']} tokens; {fix})")
    return "; ".join(parts)


def turns_of(prompt: Prompt, max_turns: int | None) -> list[str]:
    """The user turns of ``prompt`` that are answered (the first ``max_turns``; all when None)."""
    return prompt.turns if max_turns is None else prompt.turns[:max_turns]


def check_prompt_ids(prompts: Sequence[Prompt]) -> None:
    """Raise ``ValueError`` when two prompts share an id (results rows are keyed by it)."""
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise ValueError(f"prompt id {p.id!r} occurs twice; results are keyed by prompt id: make them unique")
        seen.add(p.id)


def warm_up(decoders: Mapping[str, Decoder], ids: list[int], request: DecodeConfig, runs: int,
            max_new_tokens: int) -> None:
    """``runs`` untimed generations of at most ``max_new_tokens`` tokens by each decoder on ``ids``."""
    short = replace(request, max_new_tokens=min(max_new_tokens, request.max_new_tokens))
    for decoder in decoders.values():
        for _ in range(runs):
            decoder.generate(ids, short)


def evaluate_prompts(
    decoders: Mapping[str, Decoder],
    tokenizer: Any,
    prompts: Sequence[Prompt],
    request: DecodeConfig,
    results: ResultsLog,
    baseline: str = BASELINE,
    max_turns: int | None = None,
    warmup: int = 1,
    warmup_max_new_tokens: int = 16,
    progress: bool = True,
    context: int | None = None,
    fingerprints: Mapping[str, str] | None = None,
) -> PromptRun:
    """Every decoder on every prompt and turn; rows already in ``results`` are kept, the others measured.

    Args:
        decoders: name -> decoder, the baseline first (the order in which they take turns).
        tokenizer: renders the conversation with its chat template (:func:`medusa_train.chat.prompts.encode_prompt`).
        prompts: the prompt set (unique ids).
        request: the generation request (``eos_token_ids`` filled in by the caller).
        results: the run's results log; new rows are appended to it one by one.
        baseline: the decoder whose answers earlier turns of the conversation hold.
        max_turns: user turns answered per prompt (None: all).
        warmup: untimed warm-up generations per decoder (only when some row remains to be measured).
        warmup_max_new_tokens: length of each warm-up generation.
        progress: show a tqdm bar (one step per prompt turn).
        context: the target's context length in positions (None: unknown); a decoder's own smaller
            ``max_model_len`` (vLLM's) lowers it (:func:`decoders_context`), so prompts too long for it are skipped
            and listed too.
        fingerprints: decoder name -> the fingerprint stored in its new rows (``measured_with``).

    Returns:
        :class:`PromptRun`: the rows, and the prompt turns skipped because they do not fit ``context``.

    Raises:
        ValueError: the baseline missing or not first, duplicate prompt ids, or a decoder's own error (the prompt,
            turn and decoder named).
        NothingFits: no prompt's first turn fits the context and none was measured before (raised before any
            decoder runs): every prompt named with its length, the setting that set the context and the fixes.
    """
    names = list(decoders)
    if not names or names[0] != baseline:
        raise ValueError(f"decoders must start with the baseline {baseline!r}, got {names}")
    check_prompt_ids(prompts)
    given_context, context = context, decoders_context(decoders, context)
    fingerprints = fingerprints or {}
    units = [(p, t) for p in prompts for t in range(1, len(turns_of(p, max_turns)) + 1)]
    done = sum(all((p.id, t, n) in results for n in names) for p, t in units)
    pending = [n for n in names if any((p.id, t, n) not in results for p, t in units)]

    # Every first turn against the context before any decoder runs (later turns follow answers not known yet).
    run = PromptRun()
    first_ids = {p.id: encode_prompt(tokenizer, conversation_messages(p, [p.turns[0]], [])) for p in prompts
                 if any((p.id, 1, n) not in results for n in names)}
    for prompt in prompts:
        if prompt.id in first_ids and (skip := overlong(prompt.id, 1, len(first_ids[prompt.id]),
                                                        request.max_new_tokens, context)):
            run.skipped.append(skip)
    if run.skipped:
        log.warning("%d of %d prompts do not fit the model's context of %d positions with max_new_tokens=%d and are "
                    "left out (summary.json lists them): %s", len(run.skipped), len(prompts), context,
                    request.max_new_tokens, describe_skips(run.skipped))
    left_out = {s["prompt_id"] for s in run.skipped}
    if prompts and len(left_out) == len(prompts):  # nothing measured before, nothing to measure now
        raise nothing_fits(run.skipped, context_limits(decoders, given_context), request.max_new_tokens)
    fitting = [p for p in prompts if p.id in first_ids and p.id not in left_out]
    if pending and warmup and fitting:
        warm_up({n: decoders[n] for n in pending}, first_ids[fitting[0].id], request, warmup, warmup_max_new_tokens)

    with tqdm(total=len(units), initial=done, disable=not progress, unit="turn", desc="medusa-eval") as bar:
        for prompt in prompts:
            answers: list[str] = []
            user_turns = turns_of(prompt, max_turns)
            for turn in range(1, len(user_turns) + 1):
                if prompt.id in left_out:
                    bar.update(1)
                    continue
                ids: list[int] | None = None
                for name in names:
                    row = results.get((prompt.id, turn, name))
                    if row is None:
                        if ids is None:
                            ids = encode_prompt(tokenizer, conversation_messages(prompt, user_turns[:turn], answers))
                            skip = overlong(prompt.id, turn, len(ids), request.max_new_tokens, context)
                            if skip:
                                log.warning("leaving out %s: it does not fit the context of %d positions",
                                            describe_skips([skip]), context)
                                run.skipped.append(skip)
                                left_out.add(prompt.id)
                                break
                        try:
                            result = decoders[name].generate(ids, request)
                        except ValueError as e:
                            raise ValueError(f"prompt {prompt.id!r} turn {turn}, decoder {name}: {e}") from e
                        text = result.text if result.text is not None else \
                            tokenizer.decode(result.tokens, skip_special_tokens=True)
                        row = make_row(prompt.id, prompt.category, turn, name, result, text, fingerprints.get(name))
                        results.append(row)
                        bar.set_postfix_str(_postfix(row), refresh=False)
                    run.rows.append(row)
                if prompt.id in left_out:
                    bar.update(1)
                    continue
                answers.append(results.get((prompt.id, turn, baseline))["text"])
                if ids is not None:
                    bar.update(1)
    return run


def conversation_messages(prompt: Prompt, user_turns: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """System message, then user turn 1, answer 1, ..., the last user turn (one more user turn than answers)."""
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for i, user in enumerate(user_turns):
        messages.append({"role": "user", "content": user})
        if i < len(user_turns) - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def _postfix(row: dict[str, Any]) -> str:
    tau = row["mean_accepted_tokens"]
    tau_text = "-" if tau is None or math.isnan(tau) else f"{tau:.2f}"
    return f"{row['decoder']} {row['tokens_per_second']:.1f} tok/s tau {tau_text}"


__all__ = ["NothingFits", "PromptRun", "check_prompt_ids", "context_limits", "conversation_messages", "describe_skips",
           "evaluate_prompts", "nothing_fits", "overlong", "turns_of", "warm_up"]
