"""The engines' own settings, the base of every decoder that runs in one (``decoder.<name>.*``): plain decoding in
vLLM (:class:`VllmSettings`) and in llama.cpp's ``llama-server`` (:class:`LlamaCppSettings`). The speculative ones
derive them: the engines' own methods in ``inference.registry`` (draft model, n-gram), a drafter type's in its folder
(:attr:`medusa_train.models.catalog.DrafterType.engine_decoders`, e.g. ``vllm_eagle3``), so a drafter's engine mapping
needs nothing of ``inference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from medusa_train.config.bounds import MAX_TOKENS, bound
from medusa_train.engines.llamacpp_env import REPACK


@dataclass
class VllmSettings:
    """Plain decoding in vLLM (:class:`~inference.decoders.vllm.VllmDecoder`), in vLLM's own environment: the same
    prompt ids, dtype, ``max_new_tokens`` and EOS ids as our decoders; the engine starts once per run.

    Attributes:
        max_model_len: tokens per sequence the engine reserves (prompt + reply must fit).
        enforce_eager: skip vLLM's ``torch.compile``: the engine starts in about 45 s instead of 2-3 min on a
            2-core CPU (decoding speed there measured in docs/vllm.md).
        gpu_memory_utilization: share of GPU memory vLLM may take (CUDA only; None: vLLM's default, 0.9).
    """

    max_model_len: int = field(default=4096, metadata=bound(1, cap=MAX_TOKENS))
    enforce_eager: bool = False
    gpu_memory_utilization: Optional[float] = field(default=None, metadata=bound(0, 1, low_open=True))

    def validate(self) -> None:
        return None


@dataclass
class LlamaCppSettings:
    """Plain decoding in llama.cpp (:class:`~inference.decoders.llamacpp.LlamaCppDecoder`): ``llama-server`` built by
    ``bash launch/install_llamacpp.sh``, on the target's GGUF as stored, greedy, the same prompt ids,
    ``max_new_tokens`` and compute threads as our decoders; the server starts once per run.

    Attributes:
        ctx_size: context tokens the server reserves (prompt + reply + drafted chain must fit).
        target_gguf: the target's GGUF; None: the model config's (``format: gguf``: ``name_or_path/gguf_file``).
        repack: llama.cpp's weight repacking for the CPU's wide instructions (``--repack``); off by default
            (:data:`~medusa_train.engines.llamacpp_env.REPACK`: it segfaults at start on the AMX Xeon here); ``true``
            where it runs.
    """

    ctx_size: int = field(default=4096, metadata=bound(1, cap=MAX_TOKENS))
    target_gguf: Optional[str] = None
    repack: bool = REPACK

    def validate(self) -> None:
        return None


__all__ = ["LlamaCppSettings", "VllmSettings"]
