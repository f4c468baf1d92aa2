"""Load an export for inference with the dtype and kernels decided, printed and recorded in one place.

Every command that decodes (``medusa-eval``, ``medusa-tune-tree``, ``medusa-generate``) and the benchmarks load
through :func:`load_for_inference`: it resolves ``dtype`` (:func:`medusa_train.config.precision.choose_dtype`) and
``cpu_kernels`` (:func:`medusa_train.loading.cpu_kernels.choose_cpu_kernels`) for the device, refusing bad
combinations before any weight is read, loads base and heads, converts the base's linear layers once (so every
decoder built on it shares the kernels), prints the two decisions and returns them as :class:`InferenceRuntime` for
the run's records (``latency_profile.json``, ``run.json``, ``summary.json``). A run without an export (plain
decoding, a draft model, the engines: ``medusa-eval model=... `` without ``export_dir``) loads the target alone
through :func:`load_target_for_inference`, with the same two decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from medusa_train.config.schema import ModelConfig, as_dataclass
from medusa_train.export import read_export_config
from medusa_train.loading.base import load_base_model, resolve_device
from medusa_train.loading.cpu_kernels import (
    DEFAULT_CPU_KERNELS,
    KernelChoice,
    PackedKernels,
    apply_cpu_kernels,
    check_cpu_kernels,
    choose_cpu_kernels,
)
from medusa_train.loading.export import export_base_config, load_export
from medusa_train.models.speculative import SpeculativeModel
from medusa_train.config.precision import DEFAULT_DTYPE, DtypeChoice, choose_dtype


@dataclass(frozen=True)
class InferenceRuntime:
    """What a model was loaded to run on.

    Attributes:
        dtype: the dtype decision (requested, used, reason, the CPU's ISA flags).
        kernels: the linear-kernel decision.
        applied: what the conversion did (layers packed, the one-row kernel measured for fp32).
    """

    dtype: DtypeChoice
    kernels: KernelChoice
    applied: PackedKernels = field(default_factory=PackedKernels)

    def describe(self) -> str:
        return f"{self.dtype.describe()}\n{self.kernels.describe()} ({self.applied.describe()})"

    def record(self) -> dict[str, Any]:
        """``{"precision": {...}, "cpu_kernels": {..., "packed_layers": n, "one_row": ..., "one_row_ms": {...}}}``
        (JSON-ready)."""
        return {"precision": self.dtype.record(), "cpu_kernels": {**self.kernels.record(), **self.applied.record()}}


def decide_runtime(requested_dtype: str | None, device: Any, cpu_kernels: str | None) -> tuple[DtypeChoice,
                                                                                                KernelChoice]:
    """Both decisions for a device, before anything loads (raises ``ValueError`` on a bad combination)."""
    check_cpu_kernels(cpu_kernels)
    dtype = choose_dtype(requested_dtype, device)
    return dtype, choose_cpu_kernels(cpu_kernels, device, dtype.dtype)


def load_for_inference(
    export_dir: str,
    model: Any = None,
    dtype: str | None = DEFAULT_DTYPE,
    device: str | None = None,
    cpu_kernels: str | None = DEFAULT_CPU_KERNELS,
    echo: Callable[[str], Any] | None = print,
    trust_remote_code: bool = False,
) -> tuple[SpeculativeModel, PreTrainedTokenizerBase, dict[str, Any], InferenceRuntime]:
    """Heads and base of ``export_dir`` in the decided dtype, on the decided kernels.

    Args:
        export_dir: the export folder.
        model: a ``model/`` config overriding the base recorded in the export.
        dtype: ``auto``, a dtype name, or None for the model config's own ``dtype``.
        device: overrides the model config's ``device``.
        cpu_kernels: ``auto``, ``packed`` or ``none`` (None: ``auto``).
        echo: where the two decisions are printed (None: nowhere).
        trust_remote_code: run the base model's own code (see :func:`~medusa_train.loading.export.load_export`;
            never turned on by the export's config.json).

    Returns:
        ``(SpeculativeModel, tokenizer, export_config, InferenceRuntime)``.

    Raises:
        FileNotFoundError: no export there.
        ValueError: a malformed file in the export (named), a bad dtype or kernel option for the device (e.g. float16
            on a CPU), before loading.
    """
    cfg = export_base_config(export_dir, read_export_config(export_dir), model, dtype, device, trust_remote_code)
    dtype_choice, kernel_choice = decide_runtime(cfg.dtype, resolve_device(cfg.device), cpu_kernels)
    medusa, tokenizer, export_config = load_export(export_dir, model=model, dtype=dtype_choice.name, device=device,
                                                   trust_remote_code=trust_remote_code)
    runtime = InferenceRuntime(dtype_choice, kernel_choice, apply_cpu_kernels(medusa.base, kernel_choice))
    if echo is not None:
        echo(runtime.describe())
    return medusa, tokenizer, export_config, runtime


class TargetOnly:
    """A target model without a drafter, for runs whose decoders use none (plain decoding, a draft model, prompt
    lookup, Lookahead, the engines): what those decoders read of a :class:`~medusa_train.models.speculative.SpeculativeModel`.

    Attributes:
        base: the ``*ForCausalLM``.
        heads, head_type: None (no drafter).
    """

    heads = None
    head_type = None

    def __init__(self, base: Any) -> None:
        self.base = base


def target_config(model: Any, dtype: str | None = DEFAULT_DTYPE, device: str | None = None) -> ModelConfig:
    """The ``model/`` config of a run without an export, with the run's ``dtype`` / ``device`` overrides applied.

    Raises:
        ValueError: ``model`` is None (a run without ``export_dir`` names its target with ``model=``), or not a
            valid ``model/`` config.
    """
    if model is None:
        raise ValueError("model: a run without export_dir needs the target model: give model=<model config> (e.g. "
                         "model=qwen2_5_coder_1_5b), or export_dir=DIR to take the base recorded in an export")
    cfg = as_dataclass(ModelConfig, model)
    overrides = {k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None}
    return dataclasses.replace(cfg, **overrides)


def load_target_for_inference(
    model: Any,
    dtype: str | None = DEFAULT_DTYPE,
    device: str | None = None,
    cpu_kernels: str | None = DEFAULT_CPU_KERNELS,
    echo: Callable[[str], Any] | None = print,
) -> tuple[TargetOnly, PreTrainedTokenizerBase, InferenceRuntime]:
    """The target alone (no export, no drafter) in the decided dtype, on the decided kernels: as
    :func:`load_for_inference` without heads.

    Returns:
        ``(TargetOnly, tokenizer, InferenceRuntime)``.

    Raises:
        ValueError: as :func:`target_config`; a bad dtype or kernel option for the device, before loading.
        FileNotFoundError / OSError: as :func:`~medusa_train.loading.base.load_base_model`.
    """
    cfg = target_config(model, dtype, device)
    dtype_choice, kernel_choice = decide_runtime(cfg.dtype, resolve_device(cfg.device), cpu_kernels)
    base, tokenizer = load_base_model(dataclasses.replace(cfg, dtype=dtype_choice.name))
    runtime = InferenceRuntime(dtype_choice, kernel_choice, apply_cpu_kernels(base, kernel_choice))
    if echo is not None:
        echo(runtime.describe())
    return TargetOnly(base), tokenizer, runtime


__all__ = ["InferenceRuntime", "TargetOnly", "decide_runtime", "load_for_inference", "load_target_for_inference",
           "target_config"]
