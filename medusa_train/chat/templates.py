"""Chat-template text for a conversation: which template to use, its rendering and the token ids of that text.

Shared by training (label masking in :mod:`medusa_train.data.tokenize`, self-distillation) and evaluation
(prompts in :mod:`medusa_train.chat.prompts`), so it lives outside the training data package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from medusa_train.chat.conversations import Conversation

# Used when the tokenizer has no chat template (base models): plain text turns,
#   "System: {content}\n" / "User: {content}\n" / "Assistant: {content}{eos}\n",
# with "Assistant:" as the generation prompt; the reply starts with a space so that the header tokenizes the same
# alone and followed by the reply. The BOS token, when the tokenizer has one, opens the text.
PLAIN_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] }}{% if eos_token %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% elif m['role'] == 'system' %}{{ 'System: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'User: ' + m['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template to use: ``chat_template`` if given, else the tokenizer's, else :data:`PLAIN_CHAT_TEMPLATE`."""
    if chat_template:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: take the default one
        own = own.get("default")
    return own if isinstance(own, str) and own else PLAIN_CHAT_TEMPLATE


class ChatTemplateError(ValueError, TemplateError):
    """A chat template that jinja could not render (a ``ValueError`` whose message names the template, jinja's
    error and the fix; still a jinja ``TemplateError``, which training counts as a skipped conversation)."""


def check_text(text: str, what: str) -> None:
    """Raise ``ValueError`` when ``text`` is not Unicode text a tokenizer can take: a lone surrogate (``\\ud800`` in
    a JSON file, or bytes that are not UTF-8 in a command-line argument), named with ``what`` and its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: character {e.start} is a lone surrogate (U+{ord(text[e.start]):04X}), which is not "
                         "text (an unpaired \\ud800-\\udfff escape in a JSON file, or bytes that are not UTF-8 on "
                         "the command line); remove or replace it") from None


def template_name(tokenizer: Any, template: str) -> str:
    """Which template ``template`` is, for messages: medusa-train's plain one, the tokenizer's own, or one passed in."""
    if template == PLAIN_CHAT_TEMPLATE:
        return "medusa-train's plain chat template"
    own = getattr(tokenizer, "chat_template", None)
    if template == own or (isinstance(own, dict) and template in own.values()):
        return f"the chat template of tokenizer {getattr(tokenizer, 'name_or_path', '') or '?'} (its " \
               "tokenizer_config.json / chat_template.jinja)"
    return "the chat_template passed in"


def render(tokenizer: Any, messages: Sequence[dict[str, str]], template: str, generation_prompt: bool) -> str:
    """The chat template's text for ``messages`` (no tokenization).

    Raises:
        ValueError: a message holds a lone surrogate (:func:`check_text`: message and position named).
        ChatTemplateError: the template fails to render (which template, what jinja said, and the fix).
    """
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            check_text(content, f"message {i} ({message.get('role')})")
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, chat_template=template
        )
    except TemplateError as e:
        raise ChatTemplateError(f"{template_name(tokenizer, template)} failed to render these messages (jinja "
                         f"{type(e).__name__}: {e}): fix that template (a tokenizer's own is the chat_template of its "
                         "tokenizer_config.json or its chat_template.jinja), or pass a working one as chat_template="
                         ) from e


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered template text; the template already holds any BOS, so none is added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_messages(messages: Conversation) -> Conversation:
    """Messages from the first user turn on, keeping a leading system turn.

    Assistant turns before the first user turn have no prompt to answer (ShareGPT's split conversations start
    with one); FastChat's preprocessing drops them too.
    """
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return []
    system = [messages[0]] if messages[0]["role"] == "system" else []
    return system + list(messages[first_user:])
