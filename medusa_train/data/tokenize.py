"""Turn a conversation into token ids and labels with the base tokenizer's chat template.

Labels are ``-100`` everywhere except on the assistant turns: each assistant message's content and the
end-of-turn token that closes it (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama-3, ``</s>`` in Mistral), not
the header that opens it (``<|im_start|>assistant\\n``) nor what the template writes after the end-of-turn token.

Method (works for any prefix-stable chat template): for each assistant message ``i``, render
``messages[:i]`` with ``add_generation_prompt=True`` (prompt plus assistant header) and ``messages[:i + 1]``
(through the end of the reply); the tokens between the two lengths are the reply. Each rendering must extend the
previous one. In text, a template that rewrites earlier turns (for example one that strips reasoning from past
replies) breaks that and raises ``TemplateNotPrefixStableError`` instead of mislabelling; in tokens, a reply whose
first token merges with the header's last one skips that conversation (reason ``token_boundary``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2.exceptions import TemplateError

from medusa_train.chat.templates import encode, prompt_messages, render, resolve_chat_template
from medusa_train.chat.conversations import Conversation

IGNORE_INDEX = -100

_PROBE_REPLY = "medusa-probe-reply"


class TemplateNotPrefixStableError(ValueError):
    """The chat template's rendering of a conversation prefix is not a prefix of the longer conversation's."""


class ConversationSkipped(ValueError):
    """A conversation yields no trainable tokens; ``reason`` is a short key for counting.

    Reasons: ``no_assistant_turn``, ``prompt_too_long`` (the first reply starts at or beyond ``max_length``),
    ``template_error`` (the template raised, e.g. roles that do not alternate), ``token_boundary`` (the reply's
    first token merges with the header's last one, so no token boundary separates prompt from reply).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message

    def __reduce__(self) -> tuple:  # picklable across worker processes
        return (type(self), (self.reason, self.detail))


def end_of_turn_ids(tokenizer: Any, chat_template: str | None = None) -> set[int]:
    """Ids that can close an assistant reply: the first token the template writes after a reply, and EOS.

    Found by rendering a probe conversation and tokenizing the text after the probe reply (``<|im_end|>\\n``
    gives ``<|im_end|>``). Empty when the template writes nothing after a reply and there is no EOS.

    Raises:
        ValueError: the template fails on a plain ``[user, assistant]`` conversation.
    """
    template = resolve_chat_template(tokenizer, chat_template)
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
    try:
        text = render(tokenizer, probe, template, generation_prompt=False)
    except TemplateError as e:
        raise ValueError(f"the chat template fails on a [user, assistant] conversation: {e}; set chat_template") from e
    at = text.rfind(_PROBE_REPLY)
    ids: set[int] = set()
    if at >= 0:
        suffix = encode(tokenizer, text[at + len(_PROBE_REPLY) :])
        ids.update(suffix[:1])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _reply_end(ids: list[int], start: int, stop: int, end_ids: set[int]) -> int:
    """End (exclusive) of the labelled reply ``ids[start:stop]``: just past its last end-of-turn token."""
    for j in range(stop - 1, start - 1, -1):
        if ids[j] in end_ids:
            return j + 1
    return stop


def _check_prefix(shorter: Sequence[Any], longer: Sequence[Any]) -> bool:
    return len(shorter) <= len(longer) and longer[: len(shorter)] == shorter


def tokenize_conversation(
    tokenizer: Any,
    messages: Conversation,
    max_length: int,
    *,
    chat_template: str | None = None,
    end_ids: set[int] | None = None,
) -> dict[str, list[int]]:
    """Token ids and assistant-only labels for one conversation.

    Args:
        tokenizer: a Hugging Face tokenizer; its chat template is used (see :func:`resolve_chat_template`).
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``. Assistant turns before
            the first user turn are dropped (:func:`prompt_messages`); turns after the last reply are not
            rendered (they would carry no label).
        max_length: keep the first ``max_length`` tokens.
        chat_template: overrides the tokenizer's template.
        end_ids: end-of-turn ids (default :func:`end_of_turn_ids`); pass them when tokenizing many conversations.

    Returns:
        ``{"input_ids": [T], "labels": [T]}`` (lists of int, T <= max_length): ``labels[t]`` is
        ``input_ids[t]`` on assistant content and end-of-turn tokens, else ``-100``. Labels are aligned with the
        inputs (no shift); the loss shifts them.

    Raises:
        ValueError: ``max_length`` is not positive.
        TemplateNotPrefixStableError: the template's text for a prefix of the conversation is not a prefix of the
            text for the longer conversation; pass a prefix-stable ``chat_template``.
        ConversationSkipped: no trainable tokens (see its ``reason``); :func:`build_dataset` counts these.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    template = resolve_chat_template(tokenizer, chat_template)
    if end_ids is None:
        end_ids = end_of_turn_ids(tokenizer, template)
    messages = prompt_messages(messages)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise ConversationSkipped("no_assistant_turn", "the conversation has no assistant turn after a user turn")

    prev_text, prev_ids = "", []
    spans: list[tuple[int, int]] = []
    for i in replies:
        try:
            header_text = render(tokenizer, messages[:i], template, generation_prompt=True)
            full_text = render(tokenizer, messages[: i + 1], template, generation_prompt=False)
        except TemplateError as e:
            raise ConversationSkipped("template_error", f"the chat template raised: {e}") from e
        if not (_check_prefix(prev_text, header_text) and _check_prefix(header_text, full_text)):
            raise TemplateNotPrefixStableError(
                f"the chat template is not prefix-stable at message {i}: rendering messages[:{i}] with the "
                "generation prompt must extend the rendering of the turns before and be extended by the reply; "
                "set a prefix-stable chat_template (for example medusa_train.chat.templates.PLAIN_CHAT_TEMPLATE)"
            )
        header_ids = encode(tokenizer, header_text)
        full_ids = encode(tokenizer, full_text)
        if not (_check_prefix(prev_ids, header_ids) and _check_prefix(header_ids, full_ids)):
            raise ConversationSkipped(
                "token_boundary", f"message {i}'s first token merges with the text before it when tokenized"
            )
        if len(header_ids) >= max_length:
            if not spans:
                raise ConversationSkipped(
                    "prompt_too_long", f"the first reply starts at token {len(header_ids)} >= max_length {max_length}"
                )
            break
        spans.append((len(header_ids), _reply_end(full_ids, len(header_ids), len(full_ids), end_ids)))
        prev_text, prev_ids = full_text, full_ids
        if len(full_ids) >= max_length:
            break

    input_ids = prev_ids[:max_length]
    labels = [IGNORE_INDEX] * len(input_ids)
    for start, stop in spans:
        stop = min(stop, len(input_ids))
        labels[start:stop] = input_ids[start:stop]
    return {"input_ids": input_ids, "labels": labels}
