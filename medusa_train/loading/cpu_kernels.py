"""Pre-packed linear layers for CPU inference: one load option, so every decoder runs on the same kernels.

PyTorch's CPU ``F.linear`` re-lays the weight out for its GEMM on every call: for one row (plain decoding) it is a
GEMV, for a few rows (a verification pass) a GEMM that packs the whole weight again, which is why a 2-token pass can
cost 1.6x a 1-token one in fp32. :class:`PackedLinear` reorders the weight once, into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's CPU freezing pass uses), and calls
``torch.ops.mkldnn._linear_pointwise`` on it:

- bf16, every row count: on AVX-512 BF16 / AMX, with the same values as ``F.linear`` (which also calls oneDNN for
  bf16, re-packing the weight each time); faster at one row and at k rows (``docs/speed.md``).
- fp32, two rows or more: oneDNN's GEMM instead of MKL's, whose results differ in the last bits (~1e-6 relative).
  For one row (every step of plain decoding) which kernel is faster depends on the CPU: MKL's GEMV measured faster
  on an AVX-512 Xeon, oneDNN's packed kernel 15% faster on an AVX2-only EPYC (``docs/speed.md``). So
  :func:`apply_cpu_kernels` measures both on the model itself (:func:`measure_one_row_kernels`: one-token forwards,
  interleaved) and keeps the faster (:func:`use_one_row_kernel`): plain decoding runs on the fastest kernel this
  CPU has, never slower than unpacked. Where the GEMV wins, fp32 keeps the original weight beside the packed one
  (twice the linear weights' memory); where oneDNN wins, the original is released.

Every decoder of a run shares the converted model, so all run on the same kernels for the same shapes.

Options (``cpu_kernels=`` of ``medusa-eval``, ``medusa-tune-tree``, ``medusa-generate``):

- ``auto`` (default): ``packed`` on a CPU where oneDNN is available, ``none`` elsewhere (CUDA has its own kernels);
- ``packed``: pack, or fail where oneDNN is missing;
- ``none``: PyTorch's default kernels.

What a packed model is: for inference only (no gradients through the packed weights, which are not parameters), on
the CPU in its final dtype (convert before packing). A bf16 layer releases its original weight unless another module
shares it (a tied lm_head keeps the embedding's). ``benchmarks/speed.py`` measures the effect; ``docs/speed.md``
holds the figures.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

CPU_KERNELS = ("auto", "packed", "none")
DEFAULT_CPU_KERNELS = "auto"
PACKED = "onednn_packed"
PLAIN = "pytorch"
ONE_ROW_GEMV = "pytorch_gemv"
ONE_ROW_ONEDNN = "onednn"
ONE_ROW_REPEATS = 5
ONE_ROW_WARMUP = 2
_PACKABLE = (torch.float32, torch.bfloat16)
_LINEAR_TYPES = (nn.Linear, Conv1D)


def check_cpu_kernels(value: str | None, key: str = "cpu_kernels") -> None:
    """Raise ``ValueError`` naming ``key`` unless ``value`` is None or one of :data:`CPU_KERNELS`."""
    if value is not None and value not in CPU_KERNELS:
        raise ValueError(f"{key} must be one of {', '.join(CPU_KERNELS)}, got {value!r}")


def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN (``torch.backends.mkldnn``) with the packed-linear ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """True when oneDNN packs ``dtype`` weights on this CPU, tried on a small weight: its bf16 path needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT, so an AVX2-only CPU packs float32 only."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class KernelChoice:
    """Which linear kernels a model runs on and why.

    Attributes:
        requested: ``auto``, ``packed`` or ``none``.
        kernels: ``onednn_packed`` or ``pytorch``.
        reason: one sentence, for logs and records.
    """

    requested: str
    kernels: str
    reason: str

    @property
    def packed(self) -> bool:
        return self.kernels == PACKED

    def describe(self) -> str:
        return f"cpu_kernels {self.kernels} ({self.requested}): {self.reason}"

    def record(self) -> dict[str, Any]:
        return {"kernels": self.kernels, "requested": self.requested, "reason": self.reason}


def choose_cpu_kernels(requested: str | None, device: torch.device | str, dtype: torch.dtype) -> KernelChoice:
    """Decide the linear kernels for a model on ``device`` in ``dtype`` (see the module docstring).

    Raises:
        ValueError: an unknown option, or ``packed`` where it cannot run (not a CPU, no oneDNN, a dtype other
            than float32 / bfloat16).
    """
    requested = DEFAULT_CPU_KERNELS if requested is None else requested
    check_cpu_kernels(requested)
    kind = torch.device(device).type
    if requested == "none":
        return KernelChoice(requested, PLAIN, "requested")
    problem = None
    if kind != "cpu":
        problem = f"the model runs on {kind}, not the CPU"
    elif not onednn_available():
        problem = "this PyTorch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    elif dtype not in _PACKABLE:
        problem = f"{dtype} weights cannot be packed (float32 and bfloat16 can)"
    elif not onednn_packs(dtype):
        problem = (f"oneDNN cannot pack {dtype} weights on this CPU (its bf16 path needs AVX-512 BW/VL/DQ or "
                   "AVX-NE-CONVERT)")
    if problem is None:
        return KernelChoice(requested, PACKED, "linear weights pre-packed once for oneDNN (no per-call packing)")
    if requested == "packed":
        raise ValueError(f"cpu_kernels=packed: {problem}; use cpu_kernels=auto or none")
    return KernelChoice(requested, PLAIN, problem)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` reordered once into oneDNN's blocked layout (inference only).

    Args:
        weight: ``[out_features, in_features]``, CPU, float32 or bfloat16.
        bias: ``[out_features]`` or None.
        keep: the parameter to keep as this module's ``weight`` (when another module shares it, e.g. an lm_head
            tied to the embedding), or None to release the original weight (``weight`` is then None).
        row_weight: the plain weight a single row is multiplied with by ``F.linear`` instead (fp32: MKL's GEMV);
            None: every row count goes to oneDNN.

    Shapes: ``[..., in_features]`` -> ``[..., out_features]``, in the weight's dtype.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, keep: nn.Parameter | None = None,
                 row_weight: Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach()
        if weight.device.type != "cpu" or weight.dtype not in _PACKABLE or weight.ndim != 2:
            raise ValueError(f"PackedLinear needs a 2-D CPU float32/bfloat16 weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # A plain attribute, not a buffer: module.to() / state_dict() must not touch the opaque oneDNN tensor.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.weight = keep
        self.bias = bias
        self.row_weight = None if row_weight is None else row_weight.detach()

    @classmethod
    def from_module(cls, layer: nn.Module, keep_weight: bool = False) -> PackedLinear:
        """From an ``nn.Linear`` (weight ``[out, in]``) or a transformers ``Conv1D`` (GPT-2; weight ``[in, out]``);
        fp32 keeps the plain weight for single rows (see the module docstring)."""
        weight = layer.weight if isinstance(layer, nn.Linear) else layer.weight.t()
        row_weight = weight if weight.dtype == torch.float32 else None
        return cls(weight, layer.bias, layer.weight if keep_weight else None, row_weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"PackedLinear holds {self.dtype} weights, got a {x.dtype} input")
        if self.row_weight is not None and x.numel() == self.in_features:  # one row: PyTorch's GEMV
            return F.linear(x, self.row_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        rows = ", one row on PyTorch's GEMV" if self.row_weight is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"onednn packed{rows}")


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` (and transformers ``Conv1D``, GPT-2's) inside ``model`` by a
    :class:`PackedLinear` (in place); returns how many.

    The lm_head (``model.get_output_embeddings()``) and tied weights (a parameter held by two modules, e.g.
    SmolLM2's lm_head and embedding) keep their ``weight``: callers read the lm_head's weight (shapes, device, heads
    that share it) and the embedding still looks tokens up in it; the packed layer packs a copy.

    Raises:
        ValueError: a linear layer whose weight needs gradients (packing is for inference) or is not a CPU
            float32 / bfloat16 tensor.
    """
    keep = _shared_weights(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(output, nn.Linear):
        keep.add(id(output.weight))
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in _LINEAR_TYPES:
                if child.weight.requires_grad:
                    raise ValueError(f"{name}: packing is for inference; call model.requires_grad_(False) first")
                parent._modules[name] = PackedLinear.from_module(child, keep_weight=id(child.weight) in keep)
                count += 1
    return count


@dataclass(frozen=True)
class PackedKernels:
    """What :func:`apply_cpu_kernels` did to a model.

    Attributes:
        packed_layers: linear layers converted (0 with PyTorch's kernels).
        one_row: the kernel a single row runs on in an fp32 packed model (``pytorch_gemv`` or ``onednn``); None
            elsewhere (bf16 runs every row count on oneDNN; unpacked models on PyTorch's).
        one_row_ms: the measurement behind ``one_row``: the fastest ms of a one-token forward on each kernel.
    """

    packed_layers: int = 0
    one_row: str | None = None
    one_row_ms: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        text = f"{self.packed_layers} linear layers"
        if self.one_row is not None:
            timed = ", ".join(f"{k} {v:.1f} ms" for k, v in self.one_row_ms.items())
            text += f"; one row on {self.one_row}, the faster per one-token forward ({timed})"
        return text

    def record(self) -> dict[str, Any]:
        return {"packed_layers": self.packed_layers, "one_row": self.one_row,
                "one_row_ms": {k: round(v, 3) for k, v in self.one_row_ms.items()}}


def _packed_rows(model: nn.Module) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m.row_weight is not None]


@torch.no_grad()
def measure_one_row_kernels(model: nn.Module, repeats: int = ONE_ROW_REPEATS) -> dict[str, float]:
    """Fastest ms of a one-token forward of a packed fp32 ``model`` (a causal LM) with single rows on PyTorch's
    GEMV and on oneDNN's packed kernel, ``repeats`` of each taking turns after ``ONE_ROW_WARMUP`` warm-ups each
    (the layers are left as they were). The fastest, not the median: the first passes over freshly packed weights
    can run 1.5x slow on a VM, which a median of five still caught.

    Raises:
        ValueError: ``model`` has no packed layer that can still run single rows on PyTorch's GEMV (not packed by
            :func:`pack_linear_layers`, packed in bf16, or already sent to oneDNN by :func:`use_one_row_kernel`).
    """
    layers = _packed_rows(model)
    if not layers:
        raise ValueError("measure_one_row_kernels needs an fp32 model packed by pack_linear_layers whose single rows "
                         "can still run on PyTorch's GEMV; this one has none (unpacked, bf16, or its one-row kernel "
                         "already chosen)")
    plain = [m.row_weight for m in layers]
    ids = torch.zeros(1, 1, dtype=torch.long, device=plain[0].device)
    times: dict[str, list[float]] = {ONE_ROW_GEMV: [], ONE_ROW_ONEDNN: []}
    try:
        for r in range(ONE_ROW_WARMUP + repeats):
            for kernel, elapsed in times.items():
                for layer, weight in zip(layers, plain):
                    layer.row_weight = weight if kernel == ONE_ROW_GEMV else None
                start = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                if r >= ONE_ROW_WARMUP:
                    elapsed.append((time.perf_counter() - start) * 1000)
    finally:
        for layer, weight in zip(layers, plain):
            layer.row_weight = weight
    return {kernel: min(elapsed) for kernel, elapsed in times.items()}


def use_one_row_kernel(model: nn.Module, kernel: str) -> None:
    """Run single rows of every fp32 :class:`PackedLinear` in ``model`` on ``kernel``: ``pytorch_gemv`` keeps
    them on ``F.linear`` with the plain weight; ``onednn`` sends them to the packed weight and releases the plain
    one (it cannot be taken back)."""
    if kernel not in (ONE_ROW_GEMV, ONE_ROW_ONEDNN):
        raise ValueError(f"one-row kernel must be {ONE_ROW_GEMV} or {ONE_ROW_ONEDNN}, got {kernel!r}")
    if kernel == ONE_ROW_ONEDNN:
        for layer in _packed_rows(model):
            layer.row_weight = None


def apply_cpu_kernels(model: nn.Module, choice: KernelChoice) -> PackedKernels:
    """Convert ``model`` (a causal LM) as ``choice`` says; an fp32 model also gets the faster one-row kernel,
    measured on it (``2 * (ONE_ROW_WARMUP + ONE_ROW_REPEATS)`` one-token forwards)."""
    if not choice.packed:
        return PackedKernels()
    count = pack_linear_layers(model)
    if not _packed_rows(model):
        return PackedKernels(count)
    timed = measure_one_row_kernels(model)
    fastest = ONE_ROW_ONEDNN if timed[ONE_ROW_ONEDNN] < timed[ONE_ROW_GEMV] else ONE_ROW_GEMV
    use_one_row_kernel(model, fastest)
    return PackedKernels(count, fastest, timed)


__all__ = ["CPU_KERNELS", "DEFAULT_CPU_KERNELS", "ONE_ROW_GEMV", "ONE_ROW_ONEDNN", "KernelChoice", "PackedKernels",
           "PackedLinear", "apply_cpu_kernels", "check_cpu_kernels", "choose_cpu_kernels", "measure_one_row_kernels",
           "onednn_available", "onednn_packs", "pack_linear_layers", "use_one_row_kernel"]
