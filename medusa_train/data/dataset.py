"""Tokenize conversations into train and eval ``datasets.Dataset`` objects with assistant-only labels: one
``datasets.map(batched=True, num_proc=...)`` over the conversations, its rows kept in Arrow (memory-mapped when
cached on disk, :mod:`medusa_train.data.tokenized_cache`), never as Python lists."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medusa_train.chat.templates import resolve_chat_template
from medusa_train.chat.conversations import Conversation
from medusa_train.data.split import split_indices
from medusa_train.data.tokenized_cache import cache_key, tokenized_once
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


ROW_COLUMNS = (*COLUMNS, "skip", "key", "length", "label_tokens")  # one row per conversation, before the split
CONVERSATIONS_PER_PROCESS = 1000  # data.num_proc=None: one tokenizing process per this many conversations
MAX_AUTO_PROCESSES = 32  # ... and at most this many (or the cores this process may use, if fewer)


def tokenize_processes(num_proc: int | None, conversations: int) -> int:
    """Processes that tokenize: ``num_proc`` when set, else one per :data:`CONVERSATIONS_PER_PROCESS` conversations
    (at about 30 ms each, 30 s of work a process, well above the start of one), at most the cores this process may
    use (its CPU affinity: under torchrun and SLURM, the node's or the task's) and :data:`MAX_AUTO_PROCESSES`."""
    if num_proc is not None:
        return num_proc
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_PROCESSES, conversations // CONVERSATIONS_PER_PROCESS))


def _row_features() -> datasets.Features:
    import datasets

    ids = datasets.List(datasets.Value("int64"))
    return datasets.Features({"input_ids": ids, "labels": ids, "skip": datasets.Value("string"),
                              "key": datasets.Value("string"), "length": datasets.Value("int64"),
                              "label_tokens": datasets.Value("int64")})


def _tokenize_batch(batch: dict[str, list], tokenizer: Any, max_length: int, template: str,
                    end_ids: set[int]) -> dict[str, list]:
    """``datasets.map(batched=True)``: the ``conversation`` column (JSON text) -> :data:`ROW_COLUMNS`; a skipped
    conversation has empty ids and its reason in ``skip``, a kept one the digest of its ids in ``key``."""
    out: dict[str, list] = {c: [] for c in ROW_COLUMNS}
    for text in batch["conversation"]:
        try:
            row = tokenize_conversation(tokenizer, json.loads(text), max_length, chat_template=template,
                                        end_ids=end_ids)
            skip = ""
        except ConversationSkipped as e:
            row, skip = {"input_ids": [], "labels": []}, e.reason
        ids = row["input_ids"]
        out["input_ids"].append(ids)
        out["labels"].append(row["labels"])
        out["skip"].append(skip)
        out["key"].append(hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest() if ids else "")
        out["length"].append(len(ids))
        out["label_tokens"].append(sum(label != IGNORE_INDEX for label in row["labels"]))
    return out


def tokenize_table(tokenizer: Any, conversations: list[Conversation], max_length: int, template: str,
                   end_ids: set[int], num_proc: int, cache_file: Path | None = None) -> datasets.Dataset:
    """One row per conversation, in order, with :data:`ROW_COLUMNS`: ``datasets.Dataset.map(batched=True,
    num_proc=num_proc)`` over the conversations (each as JSON text, so the template sees exactly the messages
    given); written to ``cache_file`` (Arrow, then memory-mapped) when given, else held in memory."""
    import datasets

    table = datasets.Dataset.from_dict({"conversation": [json.dumps(c, ensure_ascii=False) for c in conversations]})
    kwargs = {"tokenizer": tokenizer, "max_length": max_length, "template": template, "end_ids": end_ids}
    return table.map(_tokenize_batch, batched=True, fn_kwargs=kwargs, num_proc=num_proc if num_proc > 1 else None,
                     remove_columns=["conversation"], features=_row_features(), desc="tokenize",
                     cache_file_name=None if cache_file is None else str(cache_file))


def _tokenized(tokenizer: Any, conversations: list[Conversation], max_length: int, template: str,
               num_proc: int, cache_dir: Path | None, local_main: bool,
               barrier: Callable[[], None] | None) -> datasets.Dataset:
    """:func:`tokenize_table`, from its cache folder under ``cache_dir`` when given (written once per node,
    :mod:`medusa_train.data.tokenized_cache`)."""
    end_ids = end_of_turn_ids(tokenizer, template)
    if cache_dir is None:
        return tokenize_table(tokenizer, conversations, max_length, template, end_ids, num_proc)

    def build(folder: Path) -> None:
        scratch = folder.with_name(f"{folder.name}.map")
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            tokenize_table(tokenizer, conversations, max_length, template, end_ids, num_proc,
                           cache_file=scratch / "rows.arrow").save_to_disk(str(folder))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    folder = Path(cache_dir) / cache_key(tokenizer, template, end_ids, max_length, conversations)
    return tokenized_once(folder, build, local_main=local_main, barrier=barrier)


def _skipped(table: datasets.Dataset) -> list[str]:
    """Each row's skip reason (empty: kept), with ``duplicate`` for a row whose tokens repeat an earlier row's.

    ShareGPT repeats prompts ("continue", "hi"), and self-distillation answers a repeated prompt with the same greedy
    reply: without this, copies would weigh more in training and, split apart, put training text in the held-out
    split (measured: 4 of the quickstart's 16 held-out conversations were copies, read at head-0 top-1 0.9-1.0).
    Rows are compared by the digest of their ids, and by the ids themselves when two digests agree.
    """
    skips, keys = list(table["skip"]), list(table["key"])
    seen: dict[str, int] = {}
    for i, (skip, key) in enumerate(zip(skips, keys)):
        if skip:
            continue
        first = seen.setdefault(key, i)
        if first != i and table[first]["input_ids"] == table[i]["input_ids"]:
            skips[i] = "duplicate"
    return skips


def build_dataset(
    tokenizer: Any,
    conversations: list[Conversation],
    max_length: int,
    eval_fraction: float,
    seed: int,
    *,
    chat_template: str | None = None,
    num_proc: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_main: bool = True,
    barrier: Callable[[], None] | None = None,
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
        num_proc: tokenize with this many processes (``datasets.map(batched=True)``); None: one per
            :data:`CONVERSATIONS_PER_PROCESS` conversations, at most the usable cores (:func:`tokenize_processes`).
        cache_dir: keep the tokenized rows in a folder under it, keyed by tokenizer, template, ``max_length`` and the
            conversations, and reuse it (:mod:`medusa_train.data.tokenized_cache`); None: in memory.
        local_main: this process writes the cache folder (``LOCAL_RANK`` 0); the others load it after ``barrier``.
        barrier: waits for every rank (collective: every rank calls it once, with ``cache_dir`` only).

    Returns:
        ``(train, eval, stats)``: two ``datasets.Dataset`` with columns ``input_ids`` and ``labels`` (lists of
        int64, length <= max_length per row; eval may have 0 rows), and a :class:`BuildStats`. Skipped
        conversations are logged as a warning: "N conversations skipped: reason=count".

    Raises:
        ValueError: ``max_length`` not positive, ``eval_fraction`` outside [0, 1), no conversations, or no
            conversation left for training after tokenization (the message says to raise ``max_length`` or
            change the data source).
        TemplateNotPrefixStableError: the chat template cannot be used this way; pass ``chat_template``.
        FileNotFoundError: with ``cache_dir``, the local main process wrote no cache folder (it failed).
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if not conversations:
        raise ValueError("no conversations to tokenize; check the data source (source/path)")
    template = resolve_chat_template(tokenizer, chat_template)
    train_idx, eval_idx = split_indices(len(conversations), eval_fraction, seed)
    table = _tokenized(tokenizer, conversations, max_length, template,
                       tokenize_processes(num_proc, len(conversations)), None if cache_dir is None else Path(cache_dir),
                       local_main, barrier)
    skips = _skipped(table)

    stats = BuildStats(conversations=len(conversations))
    stats.skipped = dict(Counter(s for s in skips if s))
    for skip, length, labelled in zip(skips, table["length"], table["label_tokens"]):
        if not skip:
            stats.kept += 1
            stats.tokens += length
            stats.label_tokens += labelled
            stats.at_max_length += length == max_length
    stats.train_indices = [i for i in train_idx if not skips[i]]
    stats.eval_indices = [i for i in eval_idx if not skips[i]]
    if stats.skipped:
        logger.warning("%s", stats.skipped_summary())
    if not stats.train_indices:
        raise ValueError(
            f"no conversation left for training after tokenization ({stats.skipped_summary() or 'none skipped'}, "
            f"{len(stats.eval_indices)} held out); raise max_length (now {max_length}) or change the data "
            "source (source/path, max_conversations)"
        )

    rows = table.select_columns(list(COLUMNS))
    return rows.select(stats.train_indices), rows.select(stats.eval_indices), stats
