"""EAGLE-3 drafters in llama.cpp: ``llama-server --spec-type draft-eagle3`` drafts with the export's drafter converted
to GGUF by llama.cpp's own converter (:mod:`~medusa_train.drafters.eagle3.gguf`, the type's ``llamacpp_gguf``); the
``llamacpp_eagle3`` decoder runs it (:data:`LLAMACPP_DECODER`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from medusa_train.config.bounds import MAX_COUNT, bound
from medusa_train.models.catalog import EngineDecoder
from medusa_train.drafters.eagle3.vllm import VLLM_METHOD
from medusa_train.engines.llamacpp_env import OUTTYPES
from medusa_train.engines.settings import LlamaCppSettings


@dataclass
class LlamaCppEagle3Settings(LlamaCppSettings):
    """llama.cpp's EAGLE-3 speculative decoding with the export's drafter (``--spec-type draft-eagle3``;
    :class:`~inference.decoders.llamacpp.LlamaCppDecoder`): a chain of at most ``draft_max`` drafted tokens per step,
    verified by the target in one pass; acceptance from the server's counters. The fields of
    :class:`~medusa_train.engines.settings.LlamaCppSettings`, and:

    Attributes:
        draft_max: the longest drafted chain (``--spec-draft-n-max``); None: the export's ``speculative_tokens``
            (the drafter's training-time-test steps).
        draft_p_min: stop drafting where the drafter's top-1 probability is below this (``--spec-draft-p-min``);
            None: llama.cpp's default.
        drafter_gguf: the drafter's GGUF; None: the export's ``llamacpp/eagle3_drafter.gguf``, converted from its
            ``speculators/`` by llama.cpp's converter when missing or older than them
            (the type's :attr:`~medusa_train.models.catalog.DrafterType.llamacpp_gguf`,
            :func:`medusa_train.drafters.eagle3.gguf.export_eagle3_gguf`, also ``medusa-export-gguf``).
        outtype: the converted drafter's weight type (``f32``, ``f16``, ``bf16``, ``q8_0``).
        method: the speculative method of the drafter llama.cpp loads, by vLLM's name
            (:attr:`~medusa_train.models.catalog.DrafterType.vllm_method`): llama.cpp converts the files vLLM serves it from.
        spec_type: llama.cpp's ``--spec-type`` for it, ``draft-eagle3``.
    """

    draft_max: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    draft_p_min: Optional[float] = field(default=None, metadata=bound(0, 1))
    drafter_gguf: Optional[str] = None
    outtype: str = "f32"
    method: ClassVar[str] = VLLM_METHOD
    spec_type: ClassVar[str] = "draft-eagle3"  # llama.cpp's --spec-type of an EAGLE-3 drafter

    def validate(self) -> None:
        if self.outtype not in OUTTYPES:
            raise ValueError(f"outtype={self.outtype!r}: choose one of {', '.join(OUTTYPES)}")


LLAMACPP_DECODER = EngineDecoder(
    "llamacpp_eagle3", "llamacpp", LlamaCppEagle3Settings,
    "llama.cpp's EAGLE-3 speculative decoding with the export's drafter as a GGUF (a chain of drafts)")

__all__ = ["LLAMACPP_DECODER", "LlamaCppEagle3Settings"]
