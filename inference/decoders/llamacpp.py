"""llama.cpp as a decoder: ``llama-server`` on the target's GGUF, plain (``llamacpp``), with the export's EAGLE-3
drafter converted to GGUF (``llamacpp_eagle3``), a draft model (``llamacpp_draft``) or its n-gram self-speculation
(``llamacpp_ngram``), on the same prompt ids, token budget and threads as ours.

The server (:class:`inference.engines.llamacpp_server.LlamaServer`) starts once per run and is stopped between
requests. It decodes the target's GGUF as stored (SmolLM2's is Q4_1, which our loader dequantizes), so its replies are
compared with plain llama.cpp's (``llamacpp``), not with ours. Greedy only; EOS: the server stops at the GGUF's
end-of-generation tokens (none when the request has no ``eos_token_ids``: it then runs to ``max_new_tokens``), and the
reply is cut after the first of the request's ``eos_token_ids``.

Counts (:mod:`inference.decoders.base`'s convention): from the server's counters for the request
(:func:`inference.engines.llamacpp_server.counter_difference`), rebuilt by
:func:`inference.decoders.engine_counts.pass_lengths`, the rule vLLM's rows share: the chains that carried drafts,
then one token for each pass without a draft (the drafter's top-1 fell below ``--spec-draft-p-min``, the n-gram found
no match, or one token was left), trimmed where an EOS cut an accepted chain; ``τ = (len(tokens) - 1) /
forward_passes``. ``wall_time_s``: the HTTP request, measured here;
``prefill_time_s``: the server's ``prompt_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference.decoders.base import DecodeConfig, DecodeResult, check_context, prompt_tensor
from inference.decoders.engine_counts import pass_lengths
from inference.engines.llamacpp_server import LlamaServer


def cut_at_eos(tokens: Sequence[int], eos_token_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``tokens`` up to and including the first of ``eos_token_ids``, and whether one was found."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return list(tokens[: i + 1]), True
    return list(tokens), False


class LlamaCppDecoder:
    """A :class:`~inference.decoders.base.Decoder` backed by one ``llama-server`` (plain or with an EAGLE-3 drafter).

    Args:
        server: the started server; the decoder closes it in :meth:`close`.
        name: the decoder's name in results (``llamacpp``, ``llamacpp_eagle3``).
        ctx_size: the server's context (prompt + reply + drafts must fit).
        draft_max: the longest drafted chain (0 for a plain server): reserved beyond the reply.
    """

    def __init__(self, server: LlamaServer, name: str, ctx_size: int, draft_max: int = 0) -> None:
        self.server = server
        self.name = name
        self.ctx_size = ctx_size
        self.draft_max = draft_max

    def generate(self, input_ids: torch.Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
                 ) -> DecodeResult:
        """One greedy reply from llama.cpp (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: empty prompt, batch > 1, temperature > 0, stop strings or a streamer asked for, or prompt +
                max_new_tokens (+ the drafted chain) beyond the server's context.
            LlamaCppError: the server failed (its log's tail).
        """
        if not config.greedy:
            raise ValueError(f"decoder {self.name!r} decodes greedily only: set temperature=0")
        if config.stop_strings:
            raise ValueError(f"decoder {self.name!r} takes token ids only: stop_strings are not supported")
        if streamer is not None:
            raise ValueError(f"decoder {self.name!r} does not stream")
        ids = prompt_tensor(input_ids, torch.device("cpu"))[0].tolist()
        check_context(len(ids), config.max_new_tokens, self.ctx_size, f"the {self.name} server's ctx_size",
                      reserve=self.draft_max + 1)
        reply = self.server.complete(ids, config.max_new_tokens, ignore_eos=not config.eos_token_ids)
        tokens, eos = cut_at_eos(reply["tokens"][: config.max_new_tokens], config.eos_token_ids)
        lengths = pass_lengths(len(tokens), reply["spec"])
        prompt_ms = reply["timings"].get("prompt_ms")
        return DecodeResult(tokens=tokens, accepted_lengths=lengths, forward_passes=len(lengths),
                            wall_time_s=float(reply["wall_s"]),
                            prefill_time_s=float(prompt_ms) / 1000 if isinstance(prompt_ms, (int, float)) else 0.0,
                            stop_reason="eos" if eos else "max_new_tokens", prompt_tokens=len(ids))

    def close(self) -> None:
        """Stop the server (idempotent)."""
        self.server.close()


__all__ = ["LlamaCppDecoder", "cut_at_eos", "pass_lengths"]  # pass_lengths: engine_counts
