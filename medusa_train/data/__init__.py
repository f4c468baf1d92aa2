"""Training data for Medusa heads: load conversations, tokenize with assistant-only labels, split, collate,
and regenerate replies with the base model (self-distillation). Sources and licenses: ``data/README.md``."""

from __future__ import annotations

from medusa_train.chat.templates import PLAIN_CHAT_TEMPLATE, resolve_chat_template
from medusa_train.chat.conversations import (
    ROLE_MAP,
    SOURCES,
    Conversation,
    LoadStats,
    Message,
    load_conversations,
    normalize_role,
    resolve_data_path,
)
from medusa_train.data.collate import Collator
from medusa_train.data.dataset import BuildStats, build_dataset
from medusa_train.data.self_distill import SelfDistillStats, block_path, self_distill
from medusa_train.data.split import split_indices
from medusa_train.data.tokenize import (
    IGNORE_INDEX,
    ConversationSkipped,
    TemplateNotPrefixStableError,
    end_of_turn_ids,
    tokenize_conversation,
)
from medusa_train.files.json_stream import JsonRecordStream

__all__ = [
    "IGNORE_INDEX",
    "PLAIN_CHAT_TEMPLATE",
    "ROLE_MAP",
    "SOURCES",
    "BuildStats",
    "Collator",
    "Conversation",
    "ConversationSkipped",
    "JsonRecordStream",
    "LoadStats",
    "Message",
    "SelfDistillStats",
    "TemplateNotPrefixStableError",
    "block_path",
    "build_dataset",
    "end_of_turn_ids",
    "load_conversations",
    "normalize_role",
    "resolve_chat_template",
    "resolve_data_path",
    "self_distill",
    "split_indices",
    "tokenize_conversation",
]
