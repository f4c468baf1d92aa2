"""Self-distillation: regenerate each conversation's reply with the base model itself.

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
arXiv:2401.10774, Section 2.3.2 "Self-Distillation") trains heads on the base model's own outputs when the
original training data is unavailable or differs from the model's distribution: heads then learn what the model
actually says. For each conversation the first user turn (with the system turn, if any) is answered greedily by
the model; the records written are ShareGPT-like and :func:`load_conversations` ("json") reads them back.

Work is split into blocks of :data:`BLOCK_CONVERSATIONS` conversations (fixed, not derived from the world size:
:mod:`medusa_train.runs.blocks`), block ``b`` written to :func:`block_path` ``{stem}.block{b:06d}{suffix}`` by rank
``b % world_size``; each record is keyed by its prompt's hash (:func:`record_id`), so a run resumed on any number of
ranks, or with a longer or reordered list, reuses every reply it has. Records are appended and flushed per batch.
Replies in the files of earlier versions (``output_path`` itself, ``{stem}.rank{r}-of-{w}{suffix}``) are copied into
the blocks instead of being generated again. Batches are left-padded with prompts sorted by length (about twice the
throughput of unsorted batches on CPU). The replies come from HF ``generate`` on the training model, or from another
engine through ``generate`` (:mod:`medusa_train.data.distill_engines`: vLLM, an OpenAI-compatible server): same
prompts (our chat template's ids), same records, same resume.

A preemption (SIGTERM, SIGUSR1: :mod:`medusa_train.runs.preemption`) while replies are generated discards the batch being
generated, keeps every record written (a batch being appended is finished first) and exits with 75
(:class:`DistillStopped`), as a training run stopped by a signal does; the rerun generates only the missing replies.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from medusa_train.runs.blocks import block_rows, check_block_size, check_rank, rank_blocks
from medusa_train.chat.templates import encode, render, resolve_chat_template
from medusa_train.chat.conversations import Conversation
from medusa_train.data.tokenize import end_of_turn_ids
from medusa_train.runs.disk_space import disk_full_named
from medusa_train.runs.drills import EXIT_AT_DISTILL_BATCH, exit_if_drilled
from medusa_train.models.generation import greedy_generate, length_batches, pad_token_id_of
from medusa_train.files.json_stream import jsonl_lines
from medusa_train.runs.preemption import PREEMPTED_EXIT_CODE, Stopped, stop_on_signals
from medusa_train.files.text_files import not_utf8, read_text

logger = logging.getLogger(__name__)

CHECKSUM_KEY = "sha256"  # of the record's other fields, see record_checksum
# (prompts as token ids, max_new_tokens, stop ids) -> per prompt (new tokens, whether a stop id ended it); a finished
# reply's tokens end with its stop id where the engine returns it (HF generate does).
GenerateFn = Callable[[list[list[int]], int, set[int]], list[tuple[list[int], bool]]]
# Conversations per block file: fixed, so a run resumed on another number of ranks finds the same blocks.
BLOCK_CONVERSATIONS = 256
DISTILL_FULL_WAYS_OUT = ("free space there or point data.self_distill_dir at a larger disk, then rerun: every whole "
                         "record is kept and only the missing replies are generated")


@dataclass
class SelfDistillStats:
    """What one :func:`self_distill` call did on its rank.

    Attributes:
        paths: this rank's block files (:func:`block_path`), in block order (a block without a prompt to answer has
            none on disk).
        assigned: conversations assigned to this rank (those of its blocks).
        already_done: assigned conversations whose record their block file already held.
        migrated: assigned conversations whose record was copied from an earlier version's file (not generated).
        no_prompt: assigned conversations without a user turn (nothing to answer).
        too_long: assigned conversations whose prompt exceeds ``max_prompt_tokens`` (skipped).
        generated: records written by this call.
        unfinished: written records whose reply hit max_new_tokens before an end-of-turn token.
        empty: written records whose reply is empty (no token, or only whitespace, before the end of turn: an
            engine that answered nothing); kept on disk so that a rerun does not ask again, left out of training
            (:func:`~medusa_train.training.data_prep.read_distilled` counts them).
    """

    paths: list[Path]
    assigned: int = 0
    already_done: int = 0
    migrated: int = 0
    no_prompt: int = 0
    too_long: int = 0
    generated: int = 0
    unfinished: int = 0
    empty: int = 0


class DistillStopped(Stopped):
    """A stop signal (SIGTERM, SIGUSR1: a preemption) arrived while replies were generated: the batch being
    generated is discarded, every record written is kept (``written`` of them by this call), and the process exits
    with :data:`~medusa_train.runs.preemption.PREEMPTED_EXIT_CODE` (75)."""

    def __init__(self, signum: int, output_path: str | Path, written: int) -> None:
        super().__init__(signum)
        self.output_path, self.written = output_path, written

    def __str__(self) -> str:
        return (f"stopped on {self.signal_name} during self-distillation into {self.output_path}'s blocks; every "
                f"record written is kept ({self.written} by this run): run the same command with resume=true to "
                f"generate only the missing replies (exit code {PREEMPTED_EXIT_CODE})")


def block_path(output_path: str | Path, block: int) -> Path:
    """The file of conversation block ``block``: ``{stem}.block{block:06d}{suffix}`` beside ``output_path``."""
    path = Path(output_path)
    return path.with_name(f"{path.stem}.block{block:06d}{path.suffix}")


def written_blocks(output_path: str | Path) -> list[Path]:
    """The block files beside ``output_path`` that exist, in block order (whatever run wrote them)."""
    path = Path(output_path)
    return sorted(path.parent.glob(f"{glob.escape(path.stem)}.block[0-9]*{glob.escape(path.suffix)}"))


def legacy_paths(output_path: str | Path) -> list[Path]:
    """The files earlier versions wrote: ``output_path`` itself (one rank) and ``{stem}.rank{r}-of-{w}{suffix}``."""
    path = Path(output_path)
    found = sorted(path.parent.glob(f"{glob.escape(path.stem)}.rank*-of-*{glob.escape(path.suffix)}"))
    return [p for p in [path, *found] if p.is_file()]


def distill_prompt(messages: Conversation) -> Conversation:
    """The prompt to answer: the leading system turn (if any) and the first user turn; empty without a user turn."""
    user = next((m for m in messages if m["role"] == "user"), None)
    if user is None:
        return []
    system = [messages[0]] if messages and messages[0]["role"] == "system" else []
    return system + [user]


def record_id(prompt: Conversation) -> str:
    """A hash of the prompt: a reply is reused for the same prompt whatever list or position it comes in (a run
    with more conversations keeps the replies it already has)."""
    return hashlib.sha1(json.dumps(prompt, sort_keys=True).encode("utf-8")).hexdigest()[:10]


def prompt_key(rid: str) -> str:
    """The prompt hash of a record id: the id itself, or the part after ``-`` in the ``"{index}-{hash}"`` ids that
    earlier versions wrote (so their records are reused too)."""
    return rid.rsplit("-", 1)[-1]


def record_checksum(record: dict[str, Any]) -> str:
    """sha256 (16 hex digits) of a record's canonical JSON without its ``sha256`` field."""
    body = {k: v for k, v in record.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def read_records(path: Path, text: str | None = None) -> list[dict[str, Any]]:
    """The records of one shard file (``text``: its content, when already read), each checked against its checksum.

    Records written before checksums were recorded (no ``sha256`` field) are taken as they are.

    Raises:
        ValueError: a file that is not UTF-8 (line and byte named), a line that is not a record, or whose content no
            longer matches its checksum (the file and the line are
            named, with the way out).
    """
    records = []
    lines = jsonl_lines(read_text(path) if text is None else text)
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "id" not in record:
                raise KeyError("id")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n} is not a self-distillation record ({e}); delete that line (its reply is "
                             "generated again) or move the file away") from e
        if CHECKSUM_KEY in record and record[CHECKSUM_KEY] != record_checksum(record):
            raise ValueError(f"{path}:{n}: the record does not match its checksum (the file was edited or damaged);"
                             " delete that line (its reply is generated again) or move the file away")
        records.append(record)
    return records


def _done_ids(path: Path) -> set[str]:
    """Ids of the records already in ``path``; a last line cut by a crash is removed from the file."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a cut last line (%d bytes) left by an interrupted run", path, len(data) - keep)
        with path.open("r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8(path, data) from None
    return {prompt_key(str(r["id"])) for r in read_records(path, text)}


def _stop_ids(model: Any, tokenizer: Any, template: str) -> set[int]:
    ids = end_of_turn_ids(tokenizer, template)
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return ids


def self_distill(
    model: Any,
    tokenizer: Any,
    conversations: list[Conversation],
    max_new_tokens: int,
    batch_size: int,
    output_path: str | Path,
    rank: int = 0,
    world_size: int = 1,
    *,
    chat_template: str | None = None,
    show_progress: bool = True,
    max_prompt_tokens: int | None = None,
    generate: GenerateFn | None = None,
    block_size: int = BLOCK_CONVERSATIONS,
) -> SelfDistillStats:
    """Answer each conversation's first user turn with ``model`` (greedy) and append the records to its block's
    JSONL file.

    Conversation ``i`` belongs to block ``i // block_size``, written to :func:`block_path` by rank ``block %
    world_size``. Each line is ``{"id", "source_index", "conversations": [{"from": "system"|"human"|"gpt",
    "value"}], "new_tokens", "finished", "sha256"}`` (``sha256``: :func:`record_checksum`, checked whenever the
    file is read back). Records whose id is already in the block file are skipped, so a restarted call (on any
    number of ranks) only generates the missing ones; each file written to is flushed after every batch.

    Args:
        model: a Hugging Face causal LM (``generate``); put it on its device and in its dtype beforehand.
        tokenizer: its tokenizer; the prompt is its chat template with the generation prompt.
        conversations: from :func:`load_conversations` (use ``require_assistant=False`` for prompt-only files).
        max_new_tokens: longest reply, in tokens.
        batch_size: the most prompts per ``generate`` call (B); the pending prompts go in as few calls as that
            allows, of even size.
        output_path: the base name of the block files (``conversations.jsonl`` -> ``conversations.block000000.jsonl``).
        rank, world_size: this process's share of the blocks.
        chat_template: overrides the tokenizer's chat template.
        show_progress: a tqdm bar, on rank 0 only.
        max_prompt_tokens: skip (and count) prompts longer than this: ShareGPT's first turns reach thousands of
            tokens, and one such prompt makes its whole left-padded batch that long. None keeps every prompt.
        generate: the engine answering each batch (see :data:`GenerateFn`); None: greedy HF ``generate`` on
            ``model``. ``model`` still gives the stop ids (its ``generation_config`` EOS).
        block_size: conversations per block file (give readers the same).

    Returns:
        :class:`SelfDistillStats` for this rank.

    Raises:
        ValueError: ``max_new_tokens``/``batch_size``/``block_size`` not positive, ``rank`` not in [0, world_size),
            or a block file (or an earlier version's file) holds lines that are not records or records that fail
            their checksum.
        DiskFullError: the disk filled while a batch's records were appended (the block file and the bytes named);
            the records written before stay and a rerun generates only the others.
        DistillStopped: SIGTERM or SIGUSR1 arrived while replies were generated (exit code 75): the batch being
            generated is discarded (one being appended is finished first), every record written is kept.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    check_rank(rank, world_size)
    check_block_size(block_size)
    template = resolve_chat_template(tokenizer, chat_template)
    pad_id = pad_token_id_of(tokenizer)
    stop_ids = _stop_ids(model, tokenizer, template)
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    blocks = rank_blocks(len(conversations), block_size, rank, world_size)
    stats = SelfDistillStats(paths=[block_path(output_path, b) for b in blocks])
    legacy: dict[str, dict[str, Any]] | None = None  # an earlier version's records by prompt hash, read if needed
    pending: list[tuple[int, str, Conversation, list[int]]] = []
    for b, path in zip(blocks, stats.paths):
        done = _done_ids(path)
        migrate = []
        for i in block_rows(b, len(conversations), block_size):
            stats.assigned += 1
            prompt = distill_prompt(conversations[i])
            if not prompt:
                stats.no_prompt += 1
                continue
            rid = record_id(prompt)
            if rid in done:
                stats.already_done += 1
                continue
            if legacy is None:
                legacy = {prompt_key(str(r["id"])): r for p in legacy_paths(output_path) for r in read_records(p)}
            if rid in legacy:
                migrate.append({**legacy[rid], "source_index": i})
                done.add(rid)
                continue
            ids = encode(tokenizer, render(tokenizer, prompt, template, True))
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                stats.too_long += 1
                continue
            pending.append((i, rid, prompt, ids))
        if migrate:
            _append(path, [{**r, CHECKSUM_KEY: record_checksum(r)} for r in migrate])
            stats.migrated += len(migrate)

    own_model = generate is None  # else an engine generates: ``model`` may be a stand-in with only a config
    if own_model:
        def generate(prompts: list[list[int]], n: int, stops: set[int]) -> list[tuple[list[int], bool]]:
            return greedy_generate(model, prompts, n, pad_id, stops)

        was_training = model.training
        model.eval()
    bar = tqdm(total=len(pending), desc="self-distill", disable=rank != 0 or not show_progress)
    try:
        with stop_on_signals(lambda signum: DistillStopped(signum, output_path, stats.generated),
                             "self-distillation: received %s; discarding the batch being generated, keeping every "
                             "record written") as signals:
            # as many batches as batch_size asks for, of even size: 520 prompts in 128s go as 5 x 104, not as
            # 4 x 128 and a last batch of 8 that decodes alone
            even = math.ceil(len(pending) / math.ceil(len(pending) / batch_size)) if pending else batch_size
            for n, chunk in enumerate(length_batches([len(item[3]) for item in pending], even), start=1):
                exit_if_drilled(EXIT_AT_DISTILL_BATCH, n, rank)
                batch = [pending[j] for j in chunk]
                replies = [(tokens[:-1] if finished and tokens and tokens[-1] in stop_ids else tokens, finished)
                           for tokens, finished in generate([item[3] for item in batch], max_new_tokens, stop_ids)]
                by_block: dict[int, list[dict[str, Any]]] = {}
                texts = []
                for (index, rid, prompt, _), (reply, finished) in zip(batch, replies):
                    texts.append(tokenizer.decode(reply, skip_special_tokens=True).strip())
                    by_block.setdefault(index // block_size, []).append(
                        _record(index, rid, prompt, texts[-1], len(reply), finished))
                with signals.held():  # the batch's records written whole and counted, then a signal stops
                    for b, records in sorted(by_block.items()):
                        _append(block_path(output_path, b), records)
                    stats.generated += len(batch)
                    stats.unfinished += sum(not finished for _, finished in replies)
                    stats.empty += sum(not text for text in texts)
                bar.update(len(batch))
    finally:
        if own_model:
            model.train(was_training)
        bar.close()
    if stats.migrated:
        logger.info("%s: %d replies copied from an earlier version's files (%s)", output_path, stats.migrated,
                    ", ".join(str(p) for p in legacy_paths(output_path)))
    if stats.too_long:
        logger.warning("%s: skipped %d prompts longer than max_prompt_tokens=%d", output_path, stats.too_long,
                       max_prompt_tokens)
    if stats.unfinished:
        logger.warning("%s: %d replies hit max_new_tokens=%d", output_path, stats.unfinished, max_new_tokens)
    if stats.empty:
        logger.warning("%s: %d replies are empty (left out of training)", output_path, stats.empty)
    return stats


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    """Append ``records`` as JSON lines to ``path``, flushed to disk.

    Raises:
        DiskFullError: no room for them (the file and the bytes named); the lines already there stay whole, and a
            last line the full disk cut is dropped by the next run (:func:`_done_ids`), which writes it again.
    """
    data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
    with disk_full_named(path, len(data), f"{len(records)} self-distillation records (this batch's replies; the "
                         "size of those still to generate is not known before they are)", DISTILL_FULL_WAYS_OUT):
        with path.open("ab") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())


def _record(index: int, rid: str, prompt: Conversation, reply: str, new_tokens: int, finished: bool) -> dict:
    """A ShareGPT-style record that ``load_conversations("json", ...)`` reads back, sealed by its checksum."""
    speaker = {"user": "human", "system": "system"}
    turns = [{"from": speaker[m["role"]], "value": m["content"]} for m in prompt]
    record = {
        "id": rid,
        "source_index": index,
        "conversations": [*turns, {"from": "gpt", "value": reply}],
        "new_tokens": new_tokens,
        "finished": finished,
    }
    return {**record, CHECKSUM_KEY: record_checksum(record)}
