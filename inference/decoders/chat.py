"""A chat reply from any decoder: apply the tokenizer's chat template, decode, return text and stats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from inference.decoders.base import DecodeConfig, DecodeResult, Decoder
from medusa_train.chat.templates import check_text, encode, render, resolve_chat_template

Message = dict[str, str]


def chat_prompt_ids(
    tokenizer: Any, messages_or_text: str | Sequence[Message], system: str | None = None
) -> list[int]:
    """Prompt ids for a chat reply.

    Args:
        tokenizer: a Hugging Face tokenizer.
        messages_or_text: a user message as a string, or a list of ``{"role", "content"}`` messages.
        system: a system message put first (only with a string prompt).

    Returns:
        The prompt ids, ending with the assistant's generation prompt. Without a chat template a string prompt is
        tokenized as plain text (with the tokenizer's special tokens, e.g. BOS).

    Raises:
        ValueError: an empty prompt, malformed messages, messages for a tokenizer without a chat template, text with
            a lone surrogate (position named), or a chat template that fails to render (jinja's error named).
    """
    if isinstance(messages_or_text, str):
        if not messages_or_text:
            raise ValueError("prompt is empty: give the user message")
        check_text(messages_or_text, "the prompt")
        if system:
            check_text(system, "the system message")
        if tokenizer.chat_template is None:
            return list(tokenizer(messages_or_text, add_special_tokens=True).input_ids)
        messages: list[Message] = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": messages_or_text})
    else:
        messages = list(messages_or_text)
        if not messages or any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        if tokenizer.chat_template is None:
            raise ValueError("this tokenizer has no chat template: pass the prompt as plain text instead of messages")
    text = render(tokenizer, messages, resolve_chat_template(tokenizer), generation_prompt=True)
    return encode(tokenizer, text)


def eos_ids(tokenizer: Any, model_generation_config: Any = None) -> tuple[int, ...]:
    """EOS ids of a tokenizer and (optionally) a model's ``generation_config`` (int or list), deduplicated."""
    ids: list[int] = []
    for source in (getattr(model_generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for value in source if isinstance(source, (list, tuple)) else [source]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return tuple(ids)


def generate(
    decoder: Decoder,
    tokenizer: Any,
    messages_or_text: str | Sequence[Message],
    config: DecodeConfig,
    streamer: Any = None,
    system: str | None = None,
) -> DecodeResult:
    """One chat reply: template, decode, text.

    ``config.eos_token_ids`` defaults to the tokenizer's EOS when empty (and the decoder's model's generation
    config EOS ids, when the decoder exposes ``model``).

    Returns:
        The decoder's :class:`DecodeResult` with ``text`` filled (special tokens skipped).

    Raises:
        ValueError: as :func:`chat_prompt_ids` and the decoder's ``generate``.
    """
    ids = chat_prompt_ids(tokenizer, messages_or_text, system)
    if not config.eos_token_ids:
        model = getattr(decoder, "model", None)
        base = getattr(model, "base", model)
        config = replace(config, eos_token_ids=eos_ids(tokenizer, getattr(base, "generation_config", None)))
    result = decoder.generate(ids, config, streamer)
    if result.text is None:
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result
