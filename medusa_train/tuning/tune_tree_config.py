"""Config schema of ``medusa-tune-tree`` (``conf/tune_tree.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from inference.tree import TOPK
from medusa_train.export.tree_files import read_latency_profile
from medusa_train.loading.cpu_kernels import DEFAULT_CPU_KERNELS, check_cpu_kernels
from medusa_train.precision import DEFAULT_DTYPE, check_dtype_name
from medusa_train.tuning.latency import DEFAULT_SIZES


@dataclass
class PromptSetConfig:
    """A prompt set (see :func:`medusa_train.prompts.load_prompts`)."""

    source: str = "sharegpt"
    path: Optional[str] = None
    offset: Optional[int] = None  # None: 0, or for ShareGPT the held-out offset (medusa_train.prompts)
    num_prompts: int = 16


@dataclass
class TuneTreeConfig:
    """``medusa-tune-tree export_dir=DIR``: measure head accuracy and latency, search the tree, write it into DIR.

    Attributes:
        export_dir: the export folder; the results are written into it.
        model: optional ``model/`` config overriding the base recorded in the export.
        dtype: the decode-time dtype: ``auto`` (bf16 where the hardware multiplies bf16 natively, fp32 elsewhere:
            what ``medusa-eval`` decodes in by default), a dtype name, or None for the model config's. Latency is
            measured in it, so the tree fits the dtype that decodes.
        device: the decode-time device (default: the model config's).
        cpu_kernels: ``auto``, ``packed`` or ``none``: the linear kernels latency is measured on (as ``medusa-eval``).
        prompts: held-out prompts for the accuracy table.
        max_new_tokens: greedy continuation length per prompt.
        generation_batch_size: prompts continued per ``generate`` call (left-padded; 1 continues each prompt alone,
            exactly as the decoder would, at a fraction of the speed).
        topk: ranks measured per head (>= the widest rank a tree may use).
        max_nodes: largest tree considered (nodes, root excluded).
        latency_sizes: tree sizes (tokens incl. root) whose verification latency is measured.
        context_length: KV-cache length during the latency measurement.
        repeats: timed repeats per size (the fastest kept: timing noise only adds).
        latency_from: reuse the ``latency_profile.json`` of this export folder (made for the same base, measured on
            the same device and dtype) instead of measuring: trees for several exports of one base are then chosen
            against one profile, whose timing noise no longer differs between them (with ``timed_prompts=0``; else
            each export's size is chosen by its own timed decoding).
        timed_prompts: the first this many tuning prompts (all of them when there are fewer) are decoded with every
            tree predicted near the best (:mod:`medusa_train.tuning.timed`), and the fastest measured is kept; 0
            keeps the predicted best.
        timed_new_tokens: tokens per reply in that timing.
    """

    export_dir: str = MISSING
    model: Optional[Any] = None
    dtype: Optional[str] = DEFAULT_DTYPE
    device: Optional[str] = None
    cpu_kernels: str = DEFAULT_CPU_KERNELS
    prompts: PromptSetConfig = field(default_factory=PromptSetConfig)
    max_new_tokens: int = 96
    generation_batch_size: int = 16
    topk: int = TOPK
    max_nodes: int = 63
    latency_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES[:9]))
    context_length: int = 256
    repeats: int = 5
    latency_from: Optional[str] = None
    timed_prompts: int = 4
    timed_new_tokens: int = 64

    def validate(self) -> None:
        check_dtype_name(self.dtype)
        check_cpu_kernels(self.cpu_kernels)
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes (the tree node budget) must be >= 1, got {self.max_nodes}")
        if self.generation_batch_size < 1:
            raise ValueError(f"generation_batch_size must be >= 1, got {self.generation_batch_size}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.max_new_tokens < 4:
            raise ValueError(f"max_new_tokens must be >= 4 to measure the heads, got {self.max_new_tokens}")
        if not self.latency_sizes or min(self.latency_sizes) < 1 or len(self.latency_sizes) < 2:
            raise ValueError(f"latency_sizes must hold at least two sizes >= 1, got {self.latency_sizes}")
        if self.timed_prompts < 0:
            raise ValueError(f"timed_prompts must be >= 0 (tuning prompts decoded with each candidate tree; 0: keep "
                             f"the predicted best), got {self.timed_prompts}")
        if self.timed_new_tokens < 8:
            raise ValueError(f"timed_new_tokens must be >= 8 (tokens per timed reply), got {self.timed_new_tokens}")
        if self.latency_from is not None:
            read_latency_profile(self.latency_from)


def register_tune_tree_schema() -> None:
    """Store :class:`TuneTreeConfig` as ``tune_tree_schema`` (``conf/tune_tree.yaml`` extends it; idempotent)."""
    ConfigStore.instance().store(name="tune_tree_schema", node=TuneTreeConfig)
