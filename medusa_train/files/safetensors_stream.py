"""A safetensors file written tensor by tensor, its sha256 computed as the bytes go out.

``safetensors.torch.save_file`` needs every tensor in memory at once. When the names, dtypes and shapes are known
before the values (the hidden-state cache knows every row's length before running the base), the header can be
written first and each tensor appended as soon as it exists, so the writer holds one tensor at a time. The result is
an ordinary safetensors file (format: https://github.com/huggingface/safetensors#format: an 8-byte little-endian
header size, a JSON header padded with spaces to a multiple of 8 bytes, then the tensors' bytes back to back in
header order) that ``safe_open``/``load_file`` read.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

# torch dtype -> the safetensors header's name for it
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor the file will hold: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * torch.empty(0, dtype=self.dtype).element_size()


def header_bytes(plan: Sequence[TensorPlan], metadata: dict[str, str] | None = None) -> bytes:
    """The size prefix and JSON header of a file holding ``plan``'s tensors in that order.

    Raises:
        ValueError: a dtype safetensors has no name for, or a name given twice.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in plan:
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {t.name!r}: safetensors has no dtype for {t.dtype}")
        if t.name in header:
            raise ValueError(f"tensor {t.name!r} is planned twice")
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def planned_size(plan: Sequence[TensorPlan], metadata: dict[str, str] | None = None) -> int:
    """The bytes the file will take on disk."""
    return len(header_bytes(plan, metadata)) + sum(t.nbytes for t in plan)


class SafetensorsStream:
    """Writes ``plan``'s tensors, in its order, to ``path``; :meth:`close` returns the file's sha256.

    Use as a context manager; leaving it early (an exception) closes the file without checking it is complete (the
    caller writes to a temporary file, see :func:`medusa_train.files.atomic.atomic_write`, so nothing half-written is kept).

    Raises:
        ValueError: a tensor written out of order, or with another dtype or shape than planned; :meth:`close` before
            every planned tensor was written.
    """

    def __init__(self, path: str | Path, plan: Sequence[TensorPlan], metadata: dict[str, str] | None = None) -> None:
        self.plan = list(plan)
        self.done = 0
        self.sha256 = hashlib.sha256()
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by close/__exit__)
        self._write(header_bytes(self.plan, metadata))

    def _write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.sha256.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor (copied to the CPU if it is elsewhere)."""
        if self.done >= len(self.plan):
            raise ValueError(f"tensor {name!r} is beyond the {len(self.plan)} planned")
        want = self.plan[self.done]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want.name, want.dtype, want.shape):
            raise ValueError(f"expected tensor {want.name!r} {want.dtype} {list(want.shape)}, got {name!r} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            self._write(memoryview(flat.view(torch.uint8).numpy()))
        self.done += 1

    def close(self) -> str:
        """Flush and close the file; returns its sha256 (hex)."""
        if self.done != len(self.plan):
            self.file.close()
            raise ValueError(f"{len(self.plan) - self.done} of {len(self.plan)} planned tensors were not written")
        self.file.close()
        return self.sha256.hexdigest()

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


__all__ = ["DTYPE_NAMES", "SafetensorsStream", "TensorPlan", "header_bytes", "planned_size"]
