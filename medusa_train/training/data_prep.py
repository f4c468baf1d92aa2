"""The ``data/`` config -> tokenized train and eval datasets, through :mod:`medusa_train.data`.

Steps, each failing before training with a message that names the setting to change:

1. conversations from the source (``sharegpt``, ``json``, ``hf_disk``) or from ``prompts`` (one user turn each);
2. with ``self_distill``: the base model answers each first user turn (greedy), through the engine
   ``self_distill_engine`` names (HF generate, vLLM, a server); rank r answers conversations
   ``r, r + world_size, ...`` into its own JSONL shard under ``self_distill_dir``, reused and completed on resume;
   after a barrier every rank reads all shards back in the original order;
3. tokenization with assistant-only labels, truncation at ``max_length`` (counted and reported), held-out split.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medusa_train.config import DataConfig, ModelConfig
from medusa_train.data import BuildStats, Conversation, LoadStats, build_dataset, load_conversations, self_distill
from medusa_train.data.conversations import normalize_record
from medusa_train.data.distill_engines import distill_engine
from medusa_train.data.json_stream import jsonl_lines
from medusa_train.data.self_distill import distill_prompt, prompt_key, record_id, shard_path
from medusa_train.prompts import SHAREGPT_HELDOUT_OFFSET

log = logging.getLogger(__name__)

DISTILLED_FILE = "conversations.jsonl"


@dataclass
class PreparedData:
    """Tokenized datasets (``input_ids``, ``labels`` columns) and what preparing them counted."""

    train: Any
    eval: Any
    stats: BuildStats
    conversations: int


def source_conversations(data: DataConfig, seed: int) -> list[Conversation]:
    """Conversations from the configured source (prompts become single user turns).

    Raises:
        ValueError, FileNotFoundError: from :func:`load_conversations` (empty file, no assistant turn, missing path).
    """
    if data.source == "prompts":
        return [[{"role": "user", "content": p}] for p in data.prompts]
    conversations, stats = load_conversations(
        data.source, data.path, data.max_conversations, seed, require_assistant=not data.self_distill,
        stride=data.stride,
    )
    log.info("data: %s", stats.summary())
    if data.source == "sharegpt" and data.path is None:
        reach = (stats.kept - 1) * data.stride + 1 if stats.stopped_early else None  # usable conversations spanned
        if reach is None or reach > SHAREGPT_HELDOUT_OFFSET:
            log.warning("training reads ShareGPT conversations past %d, where the default held-out prompts of "
                        "medusa-tune-tree and benchmarks start: measure on other prompts (prompts.offset) or lower "
                        "data.max_conversations * data.stride (now %s)", SHAREGPT_HELDOUT_OFFSET,
                        "all" if reach is None else reach)
    return conversations


def read_distilled(conversations: list[Conversation], output_path: Path, world_size: int) -> list[Conversation]:
    """The regenerated conversations of every rank's shard, in the order of ``conversations``.

    Call it after every rank's :func:`self_distill` returned (a barrier): prompts without a record then are the ones
    self-distillation skipped (longer than ``max_length``), counted in a warning. Only records whose id matches a
    current prompt are used (a shard may hold records of an earlier prompt list).

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
    for rank in range(world_size):
        path = shard_path(output_path, rank, world_size)
        if not path.is_file():
            continue
        for line in jsonl_lines(path.read_text(encoding="utf-8")):
            if line.strip():
                record = json.loads(line)
                for i in wanted.get(prompt_key(str(record.get("id", ""))), []):
                    records[i] = record
    prompts = sum(len(v) for v in wanted.values())
    if not records:
        raise ValueError(f"self-distillation answered none of the {prompts} prompts (all longer than max_length?);"
                         " raise max_length or use shorter prompts")
    if len(records) != prompts:
        log.warning("self-distillation: %d of %d prompts have no reply (longer than data.max_prompt_tokens or "
                    "max_length) and are left out", prompts - len(records), prompts)
    stats = LoadStats(source="self_distill", path=str(output_path))
    distilled = [normalize_record(records[i], stats, require_assistant=True) for i in sorted(records)]
    return [c for c in distilled if c is not None]


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
) -> PreparedData:
    """Run steps 1-3 of the module docstring on every rank (collective: ``barrier`` is called by all).

    ``model_config`` is the base model's ``model/`` config, which ``self_distill_engine=vllm`` loads in vLLM.

    Raises:
        ValueError: no usable conversation, a file without records, every conversation skipped by tokenization.
        FileNotFoundError: a missing data file or package.
        VllmUnavailable / ServerError: the self-distillation engine is missing or unreachable (named), with every
            record written so far kept.
    """
    conversations = source_conversations(data, seed)
    if data.self_distill:
        output_path = self_distill_dir / DISTILLED_FILE
        # a prompt of max_length tokens or more leaves no room for a labelled reply: do not generate one
        max_prompt = min(max_length - 1, data.max_prompt_tokens or max_length)
        started = time.perf_counter()
        with distill_engine(data, model, tokenizer, model_config, max_prompt) as (generate, engine):
            stats = self_distill(model, tokenizer, conversations, data.max_new_tokens, data.generation_batch_size,
                                 output_path, rank, world_size, max_prompt_tokens=max_prompt, generate=generate)
        log.info("self-distillation (rank %d) by %s in %.0f s: %s", rank, engine, time.perf_counter() - started,
                 stats)
        barrier()
        conversations = read_distilled(conversations, output_path, world_size)
    train, held_out, build = build_dataset(tokenizer, conversations, max_length, data.eval_fraction, seed,
                                           num_proc=data.num_proc)
    if build.at_max_length:
        log.warning(
            "%d of %d conversations are longer than max_length=%d tokens and were truncated to it "
            "(raise max_length to keep them whole)", build.at_max_length, build.kept, max_length,
        )
    log.info("data: %d train and %d eval conversations, %d tokens, %d labelled", len(train), len(held_out),
             build.tokens, build.label_tokens)
    return PreparedData(train=train, eval=held_out, stats=build, conversations=len(conversations))
