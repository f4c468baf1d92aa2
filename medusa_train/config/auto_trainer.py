"""``trainer=auto`` (the default of ``conf/train.yaml``): the trainer preset this machine trains with, decided once.

The rule: the GPU preset ``ddp`` (data parallel under torchrun, one plain process without a launcher; bf16) when
CUDA is available to this process, else the CPU preset ``cpu`` (one process, fp32, the quickstart's settings).
``conf/trainer/auto.yaml`` composes the chosen preset through the ``${medusa.auto_trainer:}`` resolver in its
defaults list, so ``trainer.<field>=...`` overrides apply on top of it as on any preset, and an explicit
``trainer=cpu`` / ``trainer=ddp`` / ``trainer=deepspeed_zero3`` bypasses the rule. ``medusa-train`` logs the
choice and its reason at start (:func:`auto_trainer`).
"""

from __future__ import annotations

GPU_PRESET = "ddp"  # conf/trainer/ddp.yaml
CPU_PRESET = "cpu"  # conf/trainer/cpu.yaml


def auto_trainer(cuda: bool | None = None) -> tuple[str, str]:
    """The preset ``trainer=auto`` stands for, and why.

    Args:
        cuda: whether CUDA is usable; None asks torch (``torch.cuda.is_available()``, which honours
            ``CUDA_VISIBLE_DEVICES``).

    Returns:
        ``(preset, reason)``: ``("ddp", "CUDA is available (N GPUs)")`` or ``("cpu", "CUDA is not available")``.
    """
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
    else:
        count = None
    if cuda:
        gpus = f" ({count} GPU{'s' if count != 1 else ''})" if count is not None else ""
        return GPU_PRESET, f"CUDA is available{gpus}"
    return CPU_PRESET, "CUDA is not available"


def auto_trainer_config() -> str:
    """The ``${medusa.auto_trainer:}`` resolver: the chosen preset's config path, absolute (``/trainer/ddp``).

    Absolute because Hydra 1.3 resolves an interpolated config entry of a defaults list to a path relative to the
    group already (``trainer/ddp``) and would then look it up under ``trainer/`` a second time.
    """
    return f"/trainer/{auto_trainer()[0]}"


def log_choice(choice: str | None) -> None:
    """Log the preset ``trainer=auto`` chose and why (``choice``: the ``trainer`` group's choice; other choices
    log nothing)."""
    if choice == "auto":
        import logging

        preset, reason = auto_trainer()
        logging.getLogger(__name__).info("trainer=auto: trainer=%s, %s (name a preset, e.g. trainer=%s, to choose "
                                         "another)", preset, reason, CPU_PRESET if preset == GPU_PRESET else GPU_PRESET)
