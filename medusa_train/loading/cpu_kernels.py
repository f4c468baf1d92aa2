"""Pre-packed linear layers for CPU inference: one load option, so every decoder runs on the same kernels.

PyTorch's CPU ``F.linear`` re-lays the weight out for its GEMM on every call: for one row (plain decoding) it is a
GEMV, for a few rows (a verification pass) a GEMM that packs the whole weight again, which is why a 2-token pass can
cost 1.6x a 1-token one in fp32. :class:`PackedLinear` reorders the weight once, into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's CPU freezing pass uses), and calls
``torch.ops.mkldnn._linear_pointwise`` on it:

- bf16, every row count: on AVX-512 BF16 / AMX, with the same values as ``F.linear`` (which also calls oneDNN for
  bf16, re-packing the weight each time); faster at one row and at k rows (``docs/speed.md``).
- fp32, two rows or more: oneDNN's GEMM instead of MKL's, whose results differ in the last bits (~1e-6 relative).
  One row stays on PyTorch's own kernel (MKL's GEMV), which measured faster than oneDNN's at one row: packing
  never slows plain decoding down, and verification passes get the flat cost of the packed GEMM. So fp32 keeps
  the original weight beside the packed one (twice the linear weights' memory).

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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

CPU_KERNELS = ("auto", "packed", "none")
DEFAULT_CPU_KERNELS = "auto"
PACKED = "onednn_packed"
PLAIN = "pytorch"
_PACKABLE = (torch.float32, torch.bfloat16)
_LINEAR_TYPES = (nn.Linear, Conv1D)


def check_cpu_kernels(value: str | None, key: str = "cpu_kernels") -> None:
    """Raise ``ValueError`` naming ``key`` unless ``value`` is None or one of :data:`CPU_KERNELS`."""
    if value is not None and value not in CPU_KERNELS:
        raise ValueError(f"{key} must be one of {', '.join(CPU_KERNELS)}, got {value!r}")


def onednn_available() -> bool:
    """True when this PyTorch build has oneDNN (``torch.backends.mkldnn``) with the packed-linear ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


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


def apply_cpu_kernels(model: nn.Module, choice: KernelChoice) -> int:
    """Convert ``model`` as ``choice`` says; returns the number of linear layers packed (0 for ``pytorch``)."""
    return pack_linear_layers(model) if choice.packed else 0


__all__ = ["CPU_KERNELS", "DEFAULT_CPU_KERNELS", "KernelChoice", "PackedLinear", "apply_cpu_kernels",
           "check_cpu_kernels", "choose_cpu_kernels", "onednn_available", "pack_linear_layers"]
