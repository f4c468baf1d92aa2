"""A minimal client for an OpenAI-compatible completions server (``vllm serve``, SGLang, TGI, ...), stdlib only.

Prompts are sent as token ids (``"prompt": [[id, ...], ...]``, which the OpenAI completions API accepts), so the
server continues exactly the ids our chat template produced. Replies come back as text; servers that return the
reply's token ids too (vLLM's ``"return_token_ids": true``) give them as ids.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class ServerError(RuntimeError):
    """The server is unreachable or answered something that is not a completion; the message names the URL."""


@dataclass
class Completion:
    """One reply: its text, its token ids when the server sent them (else None), and whether a stop token ended it
    (``finish_reason == "stop"``; False: it ran to ``max_tokens``)."""

    text: str
    token_ids: list[int] | None
    finished: bool


def _call(url: str, payload: dict[str, Any] | None, timeout: float) -> Any:
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                     method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode("utf-8", errors="replace")
        raise ServerError(f"{url} answered HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:  # refused, unreachable, timed out
        raise ServerError(f"{url} is unreachable: {getattr(e, 'reason', e)}") from e
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServerError(f"{url} answered something that is not JSON: {body[:200]!r}") from e


def served_model(base_url: str, timeout: float = 30.0) -> str:
    """The first model ``GET {base_url}/v1/models`` lists.

    Raises:
        ServerError: unreachable, or no model listed.
    """
    url = f"{base_url.rstrip('/')}/v1/models"
    answer = _call(url, None, timeout)
    try:
        return str(answer["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as e:
        raise ServerError(f"{url} lists no model ({str(answer)[:200]}); set the model name explicitly") from e


def complete(
    base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int, stop_token_ids: Sequence[int] = (),
    timeout: float = 600.0, vocab_size: int | None = None,
) -> list[Completion]:
    """Greedy completions of token-id prompts in one ``POST {base_url}/v1/completions`` request.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        model: the served model's name.
        prompts: B prompts as token ids.
        max_tokens: the longest reply.
        stop_token_ids: extra stop ids (vLLM's extension; other servers stop at the model's EOS).
        timeout: seconds to wait for the answer.
        vocab_size: the tokenizer's vocabulary V: returned token ids must lie in ``[0, V)`` (None: only ``>= 0``).

    Returns:
        B completions in prompt order.

    Raises:
        ServerError: the server is down, times out, answers something other than B completions, or returns token
            ids that are not integers in ``[0, vocab_size)`` (URL, completion and ids named).
    """
    url = f"{base_url.rstrip('/')}/v1/completions"
    payload = {"model": model, "prompt": [list(map(int, p)) for p in prompts], "max_tokens": int(max_tokens),
               "temperature": 0.0, "top_p": 1.0, "n": 1, "stop_token_ids": [int(t) for t in stop_token_ids],
               "return_token_ids": True}
    answer = _call(url, payload, timeout)
    try:
        choices = sorted(answer["choices"], key=lambda c: int(c["index"]))
        replies = [Completion(text=str(c["text"]),
                              token_ids=None if c.get("token_ids") is None else list(c["token_ids"]),
                              finished=c.get("finish_reason") == "stop") for c in choices]
    except (KeyError, TypeError, ValueError) as e:
        raise ServerError(f"{url} answered without completions: {str(answer)[:300]}") from e
    if len(replies) != len(prompts):
        raise ServerError(f"{url} answered {len(replies)} completions for {len(prompts)} prompts")
    for i, reply in enumerate(replies):
        bad = [t for t in reply.token_ids or () if not isinstance(t, int) or isinstance(t, bool) or t < 0
               or (vocab_size is not None and t >= vocab_size)]
        if bad:
            limit = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
            raise ServerError(f"{url} returned token ids that are not integers in the tokenizer's vocabulary {limit} "
                              f"in completion {i}: {bad[:10]}; is the server serving model {model!r} with this "
                              "tokenizer?")
    return replies


__all__ = ["Completion", "ServerError", "complete", "served_model"]
