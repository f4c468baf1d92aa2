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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from inference.decoders.base import DecodeConfig, Decoder
from inference.evaluation.results import ResultsLog, make_row
from medusa_train.prompts import Prompt, encode_prompt


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
    baseline: str = "vanilla",
    max_turns: int | None = None,
    warmup: int = 1,
    warmup_max_new_tokens: int = 16,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Every decoder on every prompt and turn; rows already in ``results`` are kept, the others measured.

    Args:
        decoders: name -> decoder, the baseline first (the order in which they take turns).
        tokenizer: renders the conversation with its chat template (:func:`medusa_train.prompts.encode_prompt`).
        prompts: the prompt set (unique ids).
        request: the generation request (``eos_token_ids`` filled in by the caller).
        results: the run's results log; new rows are appended to it one by one.
        baseline: the decoder whose answers earlier turns of the conversation hold.
        max_turns: user turns answered per prompt (None: all).
        warmup: untimed warm-up generations per decoder (only when some row remains to be measured).
        warmup_max_new_tokens: length of each warm-up generation.
        progress: show a tqdm bar (one step per prompt turn).

    Returns:
        The rows of this prompt set in run order (prompt, turn, decoder), resumed and new alike.

    Raises:
        ValueError: the baseline missing or not first, duplicate prompt ids, or a decoder's own error.
    """
    names = list(decoders)
    if not names or names[0] != baseline:
        raise ValueError(f"decoders must start with the baseline {baseline!r}, got {names}")
    check_prompt_ids(prompts)
    units = [(p, t) for p in prompts for t in range(1, len(turns_of(p, max_turns)) + 1)]
    done = sum(all((p.id, t, n) in results for n in names) for p, t in units)
    pending = [n for n in names if any((p.id, t, n) not in results for p, t in units)]
    if pending and warmup and prompts:
        first = prompts[0]
        warm_up({n: decoders[n] for n in pending},
                encode_prompt(tokenizer, conversation_messages(first, [first.turns[0]], [])), request, warmup,
                warmup_max_new_tokens)

    rows: list[dict[str, Any]] = []
    with tqdm(total=len(units), initial=done, disable=not progress, unit="turn", desc="medusa-eval") as bar:
        for prompt in prompts:
            answers: list[str] = []
            user_turns = turns_of(prompt, max_turns)
            for turn in range(1, len(user_turns) + 1):
                ids: list[int] | None = None
                for name in names:
                    row = results.get((prompt.id, turn, name))
                    if row is None:
                        if ids is None:
                            ids = encode_prompt(tokenizer, conversation_messages(prompt, user_turns[:turn], answers))
                        result = decoders[name].generate(ids, request)
                        text = result.text if result.text is not None else \
                            tokenizer.decode(result.tokens, skip_special_tokens=True)
                        row = make_row(prompt.id, prompt.category, turn, name, result, text)
                        results.append(row)
                        bar.set_postfix_str(_postfix(row), refresh=False)
                    rows.append(row)
                answers.append(results.get((prompt.id, turn, baseline))["text"])
                if ids is not None:
                    bar.update(1)
    return rows


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


__all__ = ["check_prompt_ids", "conversation_messages", "evaluate_prompts", "turns_of", "warm_up"]
