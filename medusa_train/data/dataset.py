"""Tokenize conversations into train and eval ``datasets.Dataset`` objects with assistant-only labels."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from medusa_train.chat import resolve_chat_template
from medusa_train.conversations import Conversation
from medusa_train.data.split import split_indices
from medusa_train.data.tokenize import (
    IGNORE_INDEX,
    ConversationSkipped,
    end_of_turn_ids,
    tokenize_conversation,
)

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

COLUMNS = ("input_ids", "labels")


@dataclass
class BuildStats:
    """What :func:`build_dataset` kept and skipped.

    Attributes:
        conversations: conversations given.
        kept: conversations with at least one labelled token (train + eval).
        skipped: skip reason -> count (see ``ConversationSkipped``; ``duplicate``: the tokens of an earlier one).
        at_max_length: kept conversations cut at ``max_length`` tokens.
        tokens, label_tokens: total input tokens and labelled tokens over train and eval.
        train_indices, eval_indices: positions in the input list of the conversations in each split.
    """

    conversations: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    at_max_length: int = 0
    tokens: int = 0
    label_tokens: int = 0
    train_indices: list[int] = field(default_factory=list)
    eval_indices: list[int] = field(default_factory=list)

    def skipped_summary(self) -> str:
        """``"N conversations skipped: reason=count, ..."``, or an empty string."""
        total = sum(self.skipped.values())
        if not total:
            return ""
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()))
        return f"{total} of {self.conversations} conversations skipped: {reasons}"


def _tokenize_row(row: dict[str, Any], tokenizer: Any, max_length: int, template: str, end_ids: set[int]) -> dict:
    try:
        out = tokenize_conversation(tokenizer, row["messages"], max_length, chat_template=template, end_ids=end_ids)
    except ConversationSkipped as e:
        return {"input_ids": [], "labels": [], "skip": e.reason}
    return {**out, "skip": ""}


def _tokenize_all(
    tokenizer: Any, conversations: list[Conversation], max_length: int, template: str, num_proc: int | None
) -> list[dict[str, Any]]:
    """``{"input_ids", "labels", "skip"}`` per conversation, in order; ``datasets.map`` runs it in parallel."""
    end_ids = end_of_turn_ids(tokenizer, template)
    kwargs = {"tokenizer": tokenizer, "max_length": max_length, "template": template, "end_ids": end_ids}
    if not num_proc or num_proc <= 1:
        return [_tokenize_row({"messages": c}, **kwargs) for c in conversations]
    import datasets

    table = datasets.Dataset.from_dict({"messages": conversations})
    mapped = table.map(_tokenize_row, fn_kwargs=kwargs, num_proc=num_proc, remove_columns=["messages"])
    return list(mapped)


def _skip_duplicates(rows: list[dict[str, Any]]) -> None:
    """Mark every row whose tokens repeat an earlier row's as skipped (``duplicate``), in place.

    ShareGPT repeats prompts ("continue", "hi"), and self-distillation answers a repeated prompt with the same greedy
    reply: without this, copies would weigh more in training and, split apart, put training text in the held-out
    split (measured: 4 of the quickstart's 16 held-out conversations were copies, read at head-0 top-1 0.9-1.0).
    """
    seen: set[tuple[int, ...]] = set()
    for r in rows:
        if r["skip"]:
            continue
        key = tuple(r["input_ids"])
        if key in seen:
            r["skip"] = "duplicate"
        seen.add(key)


def build_dataset(
    tokenizer: Any,
    conversations: list[Conversation],
    max_length: int,
    eval_fraction: float,
    seed: int,
    *,
    chat_template: str | None = None,
    num_proc: int | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset, BuildStats]:
    """Tokenize conversations and split them, by conversation, into train and eval datasets.

    Each conversation becomes one example (see :func:`tokenize_conversation`: assistant-only labels, the first
    ``max_length`` tokens). Which conversations are held out depends only on ``(len(conversations),
    eval_fraction, seed)`` (:func:`split_indices`), not on which ones tokenization skips. A conversation whose
    tokens repeat an earlier one's is skipped (``duplicate``), so no copy lands on either side of the split.

    Args:
        tokenizer: the base model's tokenizer (its chat template, or the plain fallback).
        conversations: from :func:`load_conversations`.
        max_length: tokens kept per conversation.
        eval_fraction: share of conversations held out, in [0, 1).
        seed: seed of the split.
        chat_template: overrides the tokenizer's chat template.
        num_proc: tokenize with this many processes (``datasets.map``); None or 1 tokenizes in this process.

    Returns:
        ``(train, eval, stats)``: two ``datasets.Dataset`` with columns ``input_ids`` and ``labels`` (lists of
        int64, length <= max_length per row; eval may have 0 rows), and a :class:`BuildStats`. Skipped
        conversations are logged as a warning: "N conversations skipped: reason=count".

    Raises:
        ValueError: ``max_length`` not positive, ``eval_fraction`` outside [0, 1), no conversations, or no
            conversation left for training after tokenization (the message says to raise ``max_length`` or
            change the data source).
        TemplateNotPrefixStableError: the chat template cannot be used this way; pass ``chat_template``.
    """
    import datasets

    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if not conversations:
        raise ValueError("no conversations to tokenize; check the data source (source/path)")
    template = resolve_chat_template(tokenizer, chat_template)
    train_idx, eval_idx = split_indices(len(conversations), eval_fraction, seed)
    rows = _tokenize_all(tokenizer, conversations, max_length, template, num_proc)
    _skip_duplicates(rows)

    stats = BuildStats(conversations=len(conversations))
    stats.skipped = dict(Counter(r["skip"] for r in rows if r["skip"]))
    for r in rows:
        if not r["skip"]:
            stats.kept += 1
            stats.tokens += len(r["input_ids"])
            stats.label_tokens += sum(label != IGNORE_INDEX for label in r["labels"])
            stats.at_max_length += len(r["input_ids"]) == max_length
    stats.train_indices = [i for i in train_idx if not rows[i]["skip"]]
    stats.eval_indices = [i for i in eval_idx if not rows[i]["skip"]]
    if stats.skipped:
        logger.warning("%s", stats.skipped_summary())
    if not stats.train_indices:
        raise ValueError(
            f"no conversation left for training after tokenization ({stats.skipped_summary() or 'none skipped'}, "
            f"{len(stats.eval_indices)} held out); raise max_length (now {max_length}) or change the data "
            "source (source/path, max_conversations)"
        )

    features = datasets.Features({c: datasets.List(datasets.Value("int64")) for c in COLUMNS})

    def subset(indices: list[int]) -> datasets.Dataset:
        return datasets.Dataset.from_dict({c: [rows[i][c] for i in indices] for c in COLUMNS}, features=features)

    return subset(stats.train_indices), subset(stats.eval_indices), stats
