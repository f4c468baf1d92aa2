"""The ``data/`` config -> tokenized train and eval datasets, through :mod:`medusa_train.data`.

Steps, each failing before training with a message that names the setting to change:

1. conversations from the source (``sharegpt``, ``json``, ``hf_disk``) or from ``prompts`` (one user turn each);
2. with ``self_distill``: the base model answers each first user turn (greedy), through the engine
   ``self_distill_engine`` names (HF generate, vLLM, a server); engine r of E (a rank, or on GPUs one vLLM engine
   per tensor-parallel group) answers the conversation blocks ``r, r + E, ...`` (fixed-size blocks, one JSONL file
   each, under ``self_distill_dir``), reused and completed on resume on any number of ranks; after a barrier every
   rank reads all blocks back in the original order;
3. tokenization with assistant-only labels, truncation at ``max_length`` (counted and reported), held-out split:
   by the local main process of each node into a folder under ``$MEDUSA_CACHE/tokenized`` (reused while tokenizer,
   data and ``max_length`` match), which the other ranks load after a barrier
   (:mod:`medusa_train.data.tokenized_cache`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medusa_train.models.generation import max_positions
from medusa_train.config.schema import DataConfig, ModelConfig, TrainerConfig
from medusa_train.data import (
    BuildStats,
    Conversation,
    LoadStats,
    build_dataset,
    load_conversations,
    resolve_data_path,
    self_distill,
)
from medusa_train.chat.conversations import normalize_record
from medusa_train.data.distill_engines import distill_engine, engine_placement_here, request_size
from medusa_train.data.self_distill import distill_prompt, prompt_key, read_records, record_id, written_blocks
from medusa_train.data.topics import holds_problem, looks_like_code
from medusa_train.data.tokenize import IGNORE_INDEX
from medusa_train.files.paths import cache_dir
from medusa_train.chat.prompts import SHAREGPT_HELDOUT_OFFSET, problem_signatures

log = logging.getLogger(__name__)

DISTILLED_FILE = "conversations.jsonl"
TOKENIZED_DIR = "tokenized"  # under medusa_train.files.paths.cache_dir(), beside the converted models


@dataclass
class PreparedData:
    """Tokenized datasets (``input_ids``, ``labels`` columns) and what preparing them counted.

    Attributes:
        train, eval: the splits.
        stats: what tokenization kept and skipped.
        conversations: conversations given to tokenization.
        load: what loading the source read and dropped (None for ``source=prompts``).
        no_reply: prompts self-distillation left without a reply (longer than ``data.max_prompt_tokens`` or
            ``max_length``, or without a user turn).
        empty_reply: prompts whose self-distilled reply is empty (left out).
    """

    train: Any
    eval: Any
    stats: BuildStats
    conversations: int
    load: LoadStats | None = None
    no_reply: int = 0
    empty_reply: int = 0

    def record(self) -> dict[str, Any]:
        """The counts the export's ``training.data`` record keeps (JSON-ready): conversations given to tokenization,
        kept in each split, skipped by reason, cut at ``max_length``, left without a self-distilled reply, and the
        input and labelled tokens over both splits; ``empty_reply``: self-distilled replies that were empty (left
        out); ``load_dropped``: what loading the source dropped, by reason (None for ``source=prompts``)."""
        stats, load = self.stats, self.load
        dropped = None if load is None else {
            "records": load.records, "empty": load.empty, "blank": load.blank, "no_assistant": load.no_assistant,
            "unknown_role": load.unknown_role, "malformed": load.malformed, "truncated_chars": load.truncated_chars}
        return {"conversations": self.conversations, "train_conversations": len(stats.train_indices),
                "eval_conversations": len(stats.eval_indices), "skipped": dict(stats.skipped),
                "at_max_length": stats.at_max_length, "no_reply": self.no_reply, "empty_reply": self.empty_reply,
                "load_dropped": dropped, "tokens": stats.tokens, "labelled_tokens": stats.label_tokens}


def check_data_source(data: DataConfig) -> None:
    """The data files exist and can be read (no model, nothing parsed): run before anything else.

    Raises:
        FileNotFoundError, PermissionError, ValueError: from :func:`resolve_data_path`, naming ``data.path``.
    """
    if data.source == "prompts":
        return
    try:
        resolve_data_path(data.source, data.path)
    except (FileNotFoundError, PermissionError) as e:
        raise type(e)(f"data.path: {e}") from e


def check_enough_data(data: PreparedData, num_heads: int, trainer: TrainerConfig, world_size: int) -> None:
    """Refuse a training split too small to train on, saying what was dropped and why.

    Too small: fewer conversations than one optimizer step takes (micro batch x accumulation steps x ranks), or no
    labelled token far enough into any conversation for the last head to have a target (head k at position t
    predicts t + k + 2, so head K-1 needs a labelled token at position K + 1 or later).

    Raises:
        ValueError: the counts, the drops (loading, self-distillation, tokenization) and what to change.
    """
    micro, accum = trainer.per_device_train_batch_size, trainer.gradient_accumulation_steps
    rows_per_step = micro * accum * world_size
    rows_per_step_text = (f"trainer.per_device_train_batch_size={micro} x trainer.gradient_accumulation_steps={accum}"
                          f" x {world_size} ranks")
    rows = len(data.train)

    def labelled(row: int, start: int = 0) -> int:
        return sum(1 for label in data.train[row]["labels"][start:] if label != IGNORE_INDEX)

    # the first row that gives the last head a target ends the scan (usually row 0)
    late = any(labelled(i, num_heads + 1) for i in range(rows))
    if rows >= rows_per_step and late:
        return
    total = sum(labelled(i) for i in range(rows))
    dropped = [data.load.summary()] if data.load is not None else []
    if data.no_reply:
        dropped.append(f"{data.no_reply} prompts without a self-distilled reply")
    if data.empty_reply:
        dropped.append(f"{data.empty_reply} prompts whose self-distilled reply is empty")
    dropped.append(data.stats.skipped_summary() or "tokenization skipped none")
    why = (f"one optimizer step takes {rows_per_step} ({rows_per_step_text})" if rows < rows_per_step else
           f"head {num_heads - 1} would never have a target (no labelled token at position {num_heads + 1} or later)")
    raise ValueError(
        f"too little data to train on: {rows} training conversations with {total} labelled tokens "
        f"({len(data.eval)} held out), and {why}. Dropped on the way: {'; '.join(dropped)}. Add conversations (check "
        "data.path and data.max_conversations) or lower trainer.per_device_train_batch_size")


def source_conversations(data: DataConfig, seed: int) -> tuple[list[Conversation], LoadStats | None]:
    """Conversations from the configured source (prompts become single user turns) and what loading counted.

    Raises:
        ValueError, FileNotFoundError: from :func:`load_conversations` (empty file, no assistant turn, missing path).
    """
    if data.source == "prompts":
        return [[{"role": "user", "content": p}] for p in data.prompts], None
    signatures = problem_signatures(data.exclude_prompts)
    conversations, stats = load_conversations(
        data.source, data.path, data.max_conversations, seed, require_assistant=not data.self_distill,
        stride=data.stride, exclude=functools.partial(holds_problem, signatures=signatures) if signatures else None,
        topic=looks_like_code if data.code_share is not None else None, topic_share=data.code_share,
    )
    log.info("data: %s", stats.summary())
    if data.source == "sharegpt" and data.path is None:
        reach = (stats.kept - 1) * data.stride + 1 if stats.stopped_early else None  # usable conversations spanned
        if reach is None or reach > SHAREGPT_HELDOUT_OFFSET:
            log.warning("training reads ShareGPT conversations past %d, where the default held-out prompts of "
                        "medusa-tune-tree and benchmarks start: measure on other prompts (prompts.offset) or lower "
                        "data.max_conversations * data.stride (now %s)", SHAREGPT_HELDOUT_OFFSET,
                        "all" if reach is None else reach)
    return conversations, stats


def read_distilled(conversations: list[Conversation], output_path: Path,
                   counts: dict[str, int] | None = None) -> list[Conversation]:
    """The regenerated conversations of every block file, in the order of ``conversations``.

    Call it after every rank's :func:`self_distill` returned (a barrier): prompts without a record then are the ones
    self-distillation skipped (longer than ``max_length``), counted in a warning. A record whose reply is empty (an
    engine that answered nothing) is left out and counted apart. Only records whose id matches a current prompt are
    used (a block may hold records of an earlier prompt list).

    Args:
        counts: filled with ``no_reply`` (conversations without a record: no user turn, or a prompt too long) and
            ``empty_reply`` (records with an empty reply).

    Raises:
        ValueError: no prompt has a reply.
    """
    wanted: dict[str, list[int]] = {}  # prompt hash -> its positions (a prompt may repeat)
    for i, c in enumerate(conversations):
        prompt = distill_prompt(c)
        if prompt:
            wanted.setdefault(record_id(prompt), []).append(i)
    if not wanted:
        raise ValueError("no conversation has a user turn to answer: self-distillation needs user prompts")
    records: dict[int, dict[str, Any]] = {}
    for path in written_blocks(output_path):
        for record in read_records(path):
            for i in wanted.get(prompt_key(str(record["id"])), []):
                records[i] = record
    prompts = sum(len(v) for v in wanted.values())
    answered = len(records)
    empty = [i for i, r in records.items() if not _reply_text(r).strip()]
    for i in empty:
        del records[i]
    if counts is not None:
        counts.update(no_reply=len(conversations) - answered, empty_reply=len(empty))
    if empty:
        log.warning("self-distillation: %d of %d replies are empty and are left out", len(empty), answered)
    if not records:
        raise ValueError(f"self-distillation answered none of the {prompts} prompts ({answered - len(empty)} "
                         f"replies, {len(empty)} of them empty; all prompts longer than max_length?): raise "
                         "max_length or use shorter prompts, and check the engine's replies")
    if answered != prompts:
        log.warning("self-distillation: %d of %d prompts have no reply (longer than data.max_prompt_tokens or "
                    "max_length) and are left out", prompts - answered, prompts)
    stats = LoadStats(source="self_distill", path=str(output_path))
    distilled = [normalize_record(records[i], stats, require_assistant=True) for i in sorted(records)]
    return [c for c in distilled if c is not None]


def _reply_text(record: dict[str, Any]) -> str:
    """The reply of a self-distillation record: its last turn's text (records are written by ``_record``)."""
    turns = record.get("conversations") or [{}]
    return str(turns[-1].get("value") or "")


def prepare_data(
    data: DataConfig,
    *,
    tokenizer: Any,
    model: Any,
    max_length: int,
    seed: int,
    self_distill_dir: Path,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    model_config: ModelConfig | None = None,
    local_rank: int = 0,
) -> PreparedData:
    """Run steps 1-3 of the module docstring on every rank (collective: ``barrier`` is called by all).

    ``model_config`` is the base model's ``model/`` config, which ``self_distill_engine=vllm`` loads in vLLM.
    ``local_rank`` 0 tokenizes (:data:`TOKENIZED_DIR` under the cache), the node's other ranks load its folder.

    Raises:
        ValueError: no usable conversation, a file without records, every conversation skipped by tokenization.
        FileNotFoundError: a missing data file or package.
        VllmUnavailable / ServerError: the self-distillation engine is missing or unreachable (named), with every
            record written so far kept.
        DistillStopped: SIGTERM or SIGUSR1 during self-distillation (exit code 75, as a preempted training run):
            every record written is kept, the engine is stopped, and the rerun generates only the missing replies.
    """
    data.check_context(max_positions(getattr(model, "config", None)))  # before reading or generating anything
    conversations, load = source_conversations(data, seed)
    counts = {"no_reply": 0, "empty_reply": 0}
    if data.self_distill:
        output_path = self_distill_dir / DISTILLED_FILE
        # a prompt of max_length tokens or more leaves no room for a labelled reply: do not generate one
        max_prompt = min(max_length - 1, data.max_prompt_tokens or max_length)
        started = time.perf_counter()
        place = engine_placement_here(data, rank, world_size)  # on GPUs, one vLLM engine per tensor-parallel group
        if place.launches:
            with distill_engine(data, model, tokenizer, model_config, max_prompt, place) as (generate, engine):
                stats = self_distill(model, tokenizer, conversations, data.max_new_tokens, request_size(data),
                                     output_path, place.engine_rank, place.engines, max_prompt_tokens=max_prompt,
                                     generate=generate)
            log.info("self-distillation (rank %d) by %s in %.0f s: %s", rank, engine, time.perf_counter() - started,
                     stats)
        barrier()
        conversations = read_distilled(conversations, output_path, counts)
    train, held_out, build = build_dataset(tokenizer, conversations, max_length, data.eval_fraction, seed,
                                           num_proc=data.num_proc, cache_dir=cache_dir() / TOKENIZED_DIR,
                                           local_main=local_rank == 0, barrier=barrier)
    if build.at_max_length:
        log.warning(
            "%d of %d conversations are longer than max_length=%d tokens and were truncated to it "
            "(raise max_length to keep them whole)", build.at_max_length, build.kept, max_length,
        )
    log.info("data: %d train and %d eval conversations, %d tokens, %d labelled", len(train), len(held_out),
             build.tokens, build.label_tokens)
    return PreparedData(train=train, eval=held_out, stats=build, conversations=len(conversations), load=load,
                        **counts)
