"""vLLM as a decoder: the real engine beside ours, on the same prompt ids, with or without the export's Medusa heads.

The engine runs in vLLM's own environment (:class:`medusa_train.engines.vllm_env.VllmWorker`), started once and kept
for every prompt. Prompts go to it as token ids, so vLLM decodes exactly the ids our decoders get (our chat template,
not vLLM's rendering); replies come back as token ids and are decoded by our tokenizer. EOS: exactly the request's
``eos_token_ids`` (vLLM's own EOS handling is off).

vLLM's Medusa (``vllm/v1/spec_decode/medusa.py``, vLLM 0.32) drafts one chain, each head's top-1 token, from the
hidden state of the last accepted token; its EAGLE-3, draft-model and n-gram speculators draft a chain too; the target
verifies the chain in one pass. Its metrics count passes that carried drafts and accepted draft tokens per position,
which give this module's counts (:func:`inference.decoders.engine_counts.pass_lengths`, the same rule as llama.cpp's):

- ``accepted_lengths``: tokens each pass emitted (accepted drafts + the bonus token), the chains rebuilt from vLLM's
  per-position acceptance counts (``spec_decode_num_accepted_tokens_per_pos``, longest first: their order is not
  known), then one token for each pass that carried no draft (the n-gram speculator found no match); trimmed where
  vLLM counted drafts accepted past an EOS or ``max_new_tokens``. They sum to ``len(tokens) - 1``.
- ``forward_passes``: their number; plain vLLM: one per token after the first.
- ``wall_time_s``: the ``LLM.generate`` call inside the worker (not the JSON round trip); ``prefill_time_s``: vLLM's
  first-token latency.

Batch 1 (one prompt per call) is the latency regime speculative decoding targets; ``benchmarks/serve_vllm.py``
measures batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from inference.decoders.base import DecodeConfig, DecodeResult, check_context, prompt_tensor
from inference.decoders.engine_counts import accepted_lengths_from_counts, pass_lengths
from medusa_train.engines.vllm_env import VllmWorker


class VllmDecoder:
    """A :class:`~inference.decoders.base.Decoder` backed by one vLLM engine (plain or with Medusa heads).

    Args:
        worker: the started engine; the decoder closes it in :meth:`close`.
        name: the decoder's name in results (``vllm``, ``vllm_medusa``).
        max_model_len: the engine's context length (prompt + reply must fit), or None.

    Greedy and sampled requests both work (vLLM's rejection sampler keeps Medusa lossless); stop strings do not
    (vLLM gets token ids only).
    """

    def __init__(self, worker: VllmWorker, name: str, max_model_len: int | None = None) -> None:
        self.worker = worker
        self.name = name
        self.max_model_len = max_model_len
        self.speculative = worker.speculative_config is not None

    def generate(self, input_ids: torch.Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
                 ) -> DecodeResult:
        """One reply from vLLM (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: empty prompt, batch > 1, stop strings or a streamer asked for, or prompt + max_new_tokens
                beyond ``max_model_len``.
            VllmError: the engine failed (its error and log named).
        """
        if config.stop_strings:
            raise ValueError(f"decoder {self.name!r} takes token ids only: stop_strings are not supported")
        if streamer is not None:
            raise ValueError(f"decoder {self.name!r} does not stream")
        ids = prompt_tensor(input_ids, torch.device("cpu"))[0].tolist()
        check_context(len(ids), config.max_new_tokens, self.max_model_len, f"the {self.name} engine's max_model_len")
        reply = self.worker.generate([ids], config.max_new_tokens, config.eos_token_ids,
                                     temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                     seed=config.seed)
        out = reply["outputs"][0]
        tokens = [int(t) for t in out["token_ids"]]
        lengths = pass_lengths(len(tokens), reply["spec"]) if self.speculative else [1] * max(len(tokens) - 1, 0)
        stop = "eos" if tokens and tokens[-1] in config.eos_token_ids and out["finish_reason"] == "stop" \
            else "max_new_tokens"
        first = out.get("first_token_s")
        return DecodeResult(tokens=tokens, accepted_lengths=lengths, forward_passes=len(lengths),
                            wall_time_s=float(reply["wall_s"]),
                            prefill_time_s=float(first) if first is not None and math.isfinite(first) else 0.0,
                            stop_reason=stop, prompt_tokens=len(ids))

    def close(self) -> None:
        """Stop the engine (idempotent)."""
        self.worker.close()


__all__ = ["VllmDecoder", "accepted_lengths_from_counts", "pass_lengths"]  # the counts: engine_counts
