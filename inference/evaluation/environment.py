"""What a measurement ran on: device, dtype, threads, library versions, the project's git commit."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from typing import Any

import torch

from medusa_train.export.configs import dtype_name
from medusa_train.files.paths import REPO_ROOT


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the checkout (with ``+dirty`` when it has uncommitted changes); None outside one."""
    if REPO_ROOT is None:
        return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "") if commit else None


def device_name(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 ...)`` or ``cpu (x86_64, 2 threads)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"


def describe_environment(model: Any) -> dict[str, Any]:
    """The run's environment for the record.

    Args:
        model: the target model (a ``SpeculativeModel`` or ``*ForCausalLM``); its first parameter gives device and
            dtype.

    Returns:
        ``{"device", "dtype", "torch_threads", "platform", "python", "versions": {...}, "git_commit"}``.
    """
    weight = next(model.parameters())
    return {
        "device": device_name(weight.device),
        "dtype": dtype_name(weight.dtype),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "medusa-train": _version("medusa-train") or _package_version()},
        "git_commit": git_commit(),
    }


def _package_version() -> str:
    from medusa_train.version import __version__

    return __version__
