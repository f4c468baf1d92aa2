"""llama.cpp as a decoder: ``llama-server`` on the target's GGUF, plain (``llamacpp``) or with the export's EAGLE-3
drafter converted to GGUF (``llamacpp_eagle3``), on the same prompt ids, token budget and threads as ours.

The server (:class:`inference.engines.llamacpp_server.LlamaServer`) starts once per run and is stopped between
requests. It decodes the target's GGUF as stored (SmolLM2's is Q4_1, which our loader dequantizes), so its replies are
compared with plain llama.cpp's (``llamacpp``), not with ours. Greedy only; EOS: the server stops at the GGUF's
end-of-generation tokens (none when the request has no ``eos_token_ids``: it then runs to ``max_new_tokens``), and the
reply is cut after the first of the request's ``eos_token_ids``.

Counts (:mod:`inference.decoders.base`'s convention), from the server's counters for the request
(:func:`inference.engines.llamacpp_server.counter_difference`): D verifying passes that carried drafts, A accepted
drafts, accepted per draft position. Each such pass emits its accepted drafts and one more token; every other
decoding pass (no draft: the drafter's top-1 fell below ``--spec-draft-p-min``, or one token was left) emits one.
So ``accepted_lengths`` is the D chains' lengths (:func:`inference.decoders.vllm.accepted_lengths_from_counts`,
longest first) followed by ``len(tokens) - 1 - (D + A)`` ones, and ``τ = (len(tokens) - 1) / forward_passes``. Where
an EOS inside an accepted chain cut the reply, llama.cpp has counted the drafts past it; the longest lengths are
then shortened until they sum to ``len(tokens) - 1``. ``wall_time_s``: the HTTP request, measured here;
``prefill_time_s``: the server's ``prompt_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from inference.decoders.base import DecodeConfig, DecodeResult, check_context, prompt_tensor
from inference.decoders.vllm import accepted_lengths_from_counts
from inference.engines.llamacpp_server import LlamaServer


def pass_lengths(new_tokens: int, spec: dict[str, Any]) -> list[int]:
    """Tokens each decoding pass emitted, from a request's counters (see the module docstring).

    Args:
        new_tokens: N, the reply's length (the prefill's token included).
        spec: ``num_drafts`` D, ``num_accepted_tokens`` A and ``accepted_per_pos`` ``[K]`` of the request.

    Returns:
        lengths summing to ``N - 1`` (none for ``N <= 1``): the D chains' (longest first), then the plain passes'.

    Raises:
        ValueError: counts that no chain produces (as :func:`accepted_lengths_from_counts`), or per-position counts
            that do not add up to A.
    """
    drafts, accepted, per_pos = spec["num_drafts"], spec["num_accepted_tokens"], spec["accepted_per_pos"]
    if sum(per_pos) != accepted:
        raise ValueError(f"accepted_per_pos {per_pos} does not add up to the {accepted} accepted drafts")
    lengths = accepted_lengths_from_counts(drafts, per_pos) if drafts else []
    total = max(new_tokens - 1, 0)
    lengths += [1] * max(total - sum(lengths), 0)
    excess = sum(lengths) - total
    for i in range(len(lengths)):  # drafts counted past an EOS (or a reply of one token): trim the longest
        cut = min(excess, lengths[i] - 1)
        lengths[i] -= cut
        excess -= cut
    return lengths[:total]  # still over only when every length is 1


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


__all__ = ["LlamaCppDecoder", "cut_at_eos", "pass_lengths"]
