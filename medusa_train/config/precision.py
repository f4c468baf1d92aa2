"""Which floating-point dtype a model runs in: ``dtype=auto`` and the checks of an explicit dtype, decided here only.

``auto`` picks bfloat16 where the hardware multiplies bf16 natively and float32 elsewhere:

- CUDA: bfloat16 when the GPU supports it (compute capability 8.0 and later), else float16.
- CPU: bfloat16 when the CPU has bf16 dot-product instructions: ``avx512_bf16`` (AVX-512 BF16) or ``amx_bf16``
  (AMX tiles) on x86, ``bf16`` (FEAT_BF16, BFMMLA) on Arm; float32 otherwise. Without them PyTorch converts bf16 to
  fp32 around every product, and a bf16 model decodes about 3x slower than an fp32 one (measured on AVX2-only EPYC
  CPUs, 2 threads, SmolLM2-135M).
- other devices (MPS, ...): float32.

An explicit dtype is honoured, with two exceptions checked before anything is loaded: ``float16`` on a CPU is refused
(half precision has no fast CPU matrix kernels here, and fp16's range overflows in activations that bf16 and fp32
hold), and ``bfloat16`` on a CPU without bf16 instructions runs but warns with the slowdown above.

The CPU's instruction-set flags come from ``/proc/cpuinfo`` (the kernel's view, Linux) and, where that file is
missing, from ``torch.cpu.get_capabilities()`` (cpuinfo's CPUID query); both agree on the machines measured.
``MEDUSA_CPU_FLAGS`` (flags separated by commas or spaces) replaces them: the test suite sets it to run as an
AVX2-only, AVX-512 BF16 or AMX CPU on any machine (``pytest --cpu=...``), subprocesses included. It changes only what
``auto`` decides and records; the kernels that run are the machine's own.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

AUTO = "auto"
CPU_FLAGS_ENV = "MEDUSA_CPU_FLAGS"  # replaces the CPU's flags (module docstring)
DEFAULT_DTYPE = AUTO  # the default ``dtype`` of every command that runs a model for inference (eval, tune, generate)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# The instruction-set flags worth recording beside a measurement (what decides the speed of fp32 and bf16 kernels).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "asimd",
             "bf16", "i8mm", "sve")
BF16_WITHOUT_INSTRUCTIONS = ("bfloat16 on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16 among its "
                             "flags): PyTorch emulates bf16 there, about 3x slower than float32 (measured on "
                             "AVX2-only EPYC CPUs, SmolLM2-135M, 2 threads); use dtype=auto or float32")
_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def dtype_names() -> tuple[str, ...]:
    """Every accepted ``dtype`` value: ``auto`` and the concrete names (short forms included)."""
    return (AUTO, *_NAMES)


def parse_dtype(name: str) -> torch.dtype:
    """A concrete dtype name (``bf16``, ``float32``, ...) -> ``torch.dtype``.

    Raises:
        ValueError: ``auto`` (resolve it with :func:`choose_dtype`) or an unknown name (the valid ones listed).
    """
    try:
        return _NAMES[name]
    except (KeyError, TypeError):
        if name == AUTO:
            raise ValueError("dtype=auto depends on the device: resolve it with choose_dtype(name, device)") from None
        raise ValueError(f"dtype must be one of {sorted(dtype_names())}, got {name!r}") from None


def check_dtype_name(name: str | None, key: str = "dtype") -> None:
    """Raise ``ValueError`` naming ``key`` unless ``name`` is None, ``auto`` or a concrete dtype name."""
    if name is not None and name not in dtype_names():
        raise ValueError(f"{key} must be one of {', '.join(dtype_names())}, got {name!r}")


@functools.lru_cache(maxsize=None)
def _cpuinfo_flags(path: str) -> frozenset[str] | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):  # x86 "flags", Arm "Features"
            flags.update(value.split())
    return frozenset(flags) if flags else None


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags, lower case: ``MEDUSA_CPU_FLAGS`` where set (see the module docstring), else
    ``/proc/cpuinfo``, else ``torch.cpu.get_capabilities()``."""
    forced = os.environ.get(CPU_FLAGS_ENV)
    if forced is not None:
        return frozenset(forced.replace(",", " ").lower().split())
    flags = _cpuinfo_flags("/proc/cpuinfo")
    if flags is not None:
        return flags
    caps = torch.cpu.get_capabilities()
    return frozenset(name for name, value in caps.items() if value is True)


def cpu_isa() -> dict[str, Any]:
    """What to record about the CPU: ``{"machine", "flags": [the ISA_FLAGS it has], "bf16_instructions": bool}``."""
    flags = cpu_flags()
    return {"machine": platform.machine() or "unknown", "flags": [f for f in ISA_FLAGS if f in flags],
            "bf16_instructions": any(f in flags for f in BF16_FLAGS)}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why.

    Attributes:
        requested: what was asked for (``auto`` or a dtype name).
        dtype: the dtype used.
        device: the device type it was decided for (``cpu``, ``cuda``, ...).
        reason: one sentence, for logs and records.
        warning: set when an explicit dtype is slow on this device (also issued as a ``RuntimeWarning``).
        cpu: :func:`cpu_isa` of this machine.
    """

    requested: str
    dtype: torch.dtype
    device: str
    reason: str
    warning: str | None = None
    cpu: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16`` or ``float16``."""
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """One line: ``dtype bfloat16 (auto): ...``."""
        return f"dtype {self.name} ({self.requested} on {self.device}): {self.reason}"

    def record(self) -> dict[str, Any]:
        """A JSON-ready record (for ``latency_profile.json``, ``summary.json``, ``run.json``)."""
        return {"dtype": self.name, "requested": self.requested, "device": self.device, "reason": self.reason,
                "warning": self.warning, "cpu": dict(self.cpu)}


def choose_dtype(requested: str | None, device: torch.device | str) -> DtypeChoice:
    """Resolve ``dtype=auto`` for ``device``, or check an explicit dtype there (see the module docstring).

    Args:
        requested: ``auto`` (None means the same) or a dtype name.
        device: where the model runs (``cpu``, ``cuda``, ``cuda:1``, a ``torch.device``).

    Returns:
        :class:`DtypeChoice`.

    Raises:
        ValueError: an unknown name, or ``float16`` on a CPU (the reason and the fix named).
    """
    requested = AUTO if requested is None else requested
    check_dtype_name(requested)
    kind = torch.device(device).type
    isa = cpu_isa()
    bf16_cpu = isa["bf16_instructions"]
    if requested == AUTO:
        if kind == "cuda":
            if torch.cuda.is_bf16_supported():
                dtype, reason = torch.bfloat16, "the GPU multiplies bf16 natively (tensor cores)"
            else:
                dtype, reason = torch.float16, "the GPU has no bf16 support (before compute capability 8.0): float16"
        elif kind == "cpu" and bf16_cpu:
            found = ", ".join(f for f in BF16_FLAGS if f in isa["flags"])
            dtype, reason = torch.bfloat16, f"this CPU has bf16 instructions ({found})"
        elif kind == "cpu":
            dtype, reason = torch.float32, ("this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16): bf16 "
                                            "would be emulated, about 3x slower than float32")
        else:
            dtype, reason = torch.float32, f"no bf16 rule for device type {kind!r}: float32"
        return DtypeChoice(requested, dtype, kind, reason, None, isa)

    dtype = parse_dtype(requested)
    warning = None
    if kind == "cpu" and dtype == torch.float16:
        raise ValueError(
            f"dtype={requested} on the CPU: PyTorch has no fast float16 matrix kernels on CPUs and fp16 overflows "
            "where bf16 and fp32 do not; use dtype=auto (bfloat16 on CPUs with bf16 instructions, float32 elsewhere), "
            "bfloat16 or float32"
        )
    if kind == "cpu" and dtype == torch.bfloat16 and not bf16_cpu:
        warning = BF16_WITHOUT_INSTRUCTIONS
        warnings.warn(warning, RuntimeWarning, stacklevel=1)  # one location: shown once per process
    return DtypeChoice(requested, dtype, kind, "requested" + (f" ({warning})" if warning else ""), warning, isa)


TRAINING_PRECISIONS = ("fp32", "bf16", "fp16", AUTO)  # trainer.precision's values


@dataclass(frozen=True)
class PrecisionChoice:
    """The mixed precision a training run uses (``trainer.precision``) and why.

    Attributes:
        requested: what was asked for (``auto``, ``fp32``, ``bf16`` or ``fp16``).
        precision: what is used: ``fp32``, ``bf16`` or ``fp16`` (the HF Trainer's ``bf16``/``fp16`` autocast).
        device: the device type it was decided for (``cpu``, ``cuda``).
        reason: one sentence, for logs and records.
        cpu: :func:`cpu_isa` of this machine.
    """

    requested: str
    precision: str
    device: str
    reason: str
    cpu: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: ``trainer.precision bf16 (auto on cpu): ...``."""
        return f"trainer.precision {self.precision} ({self.requested} on {self.device}): {self.reason}"

    def record(self) -> dict[str, Any]:
        """A JSON-ready record (the export's ``training`` entry)."""
        return {"precision": self.precision, "requested": self.requested, "device": self.device,
                "reason": self.reason, "cpu": dict(self.cpu)}


def choose_precision(requested: str, device: torch.device | str) -> PrecisionChoice:
    """Resolve ``trainer.precision=auto`` for the training device, or pass an explicit precision through.

    ``auto`` follows :func:`choose_dtype`'s rule for ``dtype=auto``: ``bf16`` where it picks bfloat16 (a CUDA GPU
    with bf16, a CPU with ``avx512_bf16``/``amx_bf16``/Arm ``bf16``), ``fp32`` everywhere else: a GPU without bf16
    trains in fp32 too (fp16 mixed precision needs loss scaling; ask for it with ``trainer.precision=fp16``).

    Args:
        requested: one of :data:`TRAINING_PRECISIONS` (checked by :class:`~medusa_train.config.schema.TrainerConfig`).
        device: where the run trains (``cpu``, ``cuda``, a ``torch.device``).
    """
    kind = torch.device(device).type
    if requested != AUTO:
        return PrecisionChoice(requested, requested, kind, "requested", cpu_isa())
    choice = choose_dtype(AUTO, device)
    if choice.dtype == torch.bfloat16:
        return PrecisionChoice(AUTO, "bf16", kind, choice.reason, choice.cpu)
    reason = choice.reason if choice.dtype == torch.float32 else (
        f"{choice.reason.removesuffix(': float16')}: fp32 (auto never picks fp16; set trainer.precision=fp16 for it)")
    return PrecisionChoice(AUTO, "fp32", kind, reason, choice.cpu)


__all__ = ["AUTO", "BF16_FLAGS", "CPU_FLAGS_ENV", "DEFAULT_DTYPE", "DtypeChoice", "PrecisionChoice",
           "TRAINING_PRECISIONS", "check_dtype_name", "choose_dtype", "choose_precision", "cpu_flags", "cpu_isa",
           "dtype_names", "parse_dtype"]
