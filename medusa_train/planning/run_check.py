"""The memory check ``medusa-train`` runs before any weight loads (:func:`check_run_memory`): the run's plan from
its config, the base's ``config.json`` (read without weights, local files only), the number of ranks and each
device's memory; a stage that cannot fit is refused with the bytes it needs, the bytes there are and the setting
that makes it fit (:func:`~medusa_train.planning.plan.find_fix`).

Where the base's config cannot be known before loading (a GGUF file, whose config transformers derives by reading
the whole file; a Hub id not in the local cache) the check is skipped with a logged reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from medusa_train.config.schema import TrainConfig
from medusa_train.planning.settings import PlanSettings, settings_from_config
from medusa_train.planning.terms import GIB, MemoryPlan

log = logging.getLogger(__name__)


def target_config_of(cfg: TrainConfig) -> tuple[Any, str | None]:
    """The base's transformers config read without its weights, and None; or None and the reason it cannot be.

    HF folders and Hub ids in the local cache: ``AutoConfig`` (``local_files_only``); llama2.c: the config its
    loader derives from the checkpoint's 28-byte header; GGUF: not known before loading (skipped).

    Raises:
        ValueError: the file lacks a size field the plan reads (:func:`~medusa_train.planning.meta.check_size_fields`:
            transformers' defaults would plan another model).
    """
    from medusa_train.loading.base import detect_format

    model = cfg.model
    fmt = detect_format(model)
    if fmt == "llama2c":
        from medusa_train.loading.llama2c import llama2c_config, read_llama2c_header

        return llama2c_config(read_llama2c_header(model.name_or_path)), None
    if fmt != "hf":
        return None, (f"model.format={fmt}: its config is derived while the weights are read (transformers parses "
                      "the whole GGUF file), so the memory plan is skipped")
    from transformers import AutoConfig

    from medusa_train.planning.meta import check_size_fields, raw_config

    try:
        config = AutoConfig.from_pretrained(model.name_or_path, revision=model.revision, local_files_only=True,
                                            trust_remote_code=model.trust_remote_code)
        raw = raw_config(model.name_or_path, revision=model.revision)
    except (OSError, ValueError) as e:
        return None, f"the config of {model.name_or_path!r} is not readable offline ({e}); the memory plan is skipped"
    check_size_fields(config, raw, f"the config.json of model.name_or_path={model.name_or_path}")
    return config, None


def host_ram_bytes() -> int | None:
    """``MemTotal`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def devices_of(cfg: TrainConfig, world_size: int) -> tuple[str, int, int, int | None]:
    """``(device type, ranks per host, bytes of one device, bytes of one host)`` of this run.

    GPUs: the smallest ``total_memory`` of the visible devices, ``LOCAL_WORLD_SIZE`` (else the world size, at most
    the device count) ranks per host. A CPU run (``trainer.use_cpu`` or no CUDA): the host's RAM shared by its
    ranks. ``plan_device_gib`` replaces the device's bytes.
    """
    host = host_ram_bytes()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world_size
    if not cfg.trainer.use_cpu and cfg.model.device != "cpu" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        per_host = min(per_host, count)
        device = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        kind = "cuda"
    else:
        kind = "cpu"
        device = (host or 0) // max(per_host, 1)
        host = None  # the per-rank share already is the host's RAM
    if cfg.plan_device_gib is not None:
        device = int(cfg.plan_device_gib * GIB)
    return kind, per_host, device, host


@dataclass(frozen=True)
class RunPlan:
    """A run's memory plan with what it was made from.

    Attributes:
        plan: the plan.
        settings: the :class:`~medusa_train.planning.settings.PlanSettings` it was made with.
        target_config: the base's transformers config.
        account: one line: the ranks, the bytes of a device and where they were read, the base's dtype.
    """

    plan: MemoryPlan
    settings: PlanSettings
    target_config: Any
    account: str


def plan_run(cfg: TrainConfig, world_size: int) -> RunPlan | str:
    """The run's :class:`RunPlan`, or the reason it cannot be made before loading (the base's config unknown)."""
    from medusa_train.planning.plan import build_plan
    from medusa_train.config.precision import choose_dtype

    target_config, reason = target_config_of(cfg)
    if target_config is None:
        return reason or "the base's config is unknown"
    kind, per_host, device_bytes, host_bytes = devices_of(cfg, world_size)
    dtype = str(choose_dtype(cfg.model.dtype, kind).dtype).removeprefix("torch.")
    settings = settings_from_config(cfg, world_size, device_bytes, gpus_per_host=per_host, host_bytes=host_bytes,
                                    base_dtype=dtype, device_kind=kind)
    source = "plan_device_gib" if cfg.plan_device_gib is not None else ("total_memory" if kind == "cuda" else
                                                                        "host RAM / ranks")
    return RunPlan(build_plan(target_config, cfg.heads, settings), settings, target_config,
                   f"{world_size} {kind} rank(s) of {device_bytes / GIB:.2f} GiB ({source}), base in {dtype}")


def check_run_memory(cfg: TrainConfig, world_size: int) -> MemoryPlan | None:
    """Plan the run (:func:`plan_run`), log the plan's table, and refuse it when a stage cannot fit.

    Returns:
        The plan, or None when it was skipped (the reason logged).

    Raises:
        ValueError: a stage needs more than a device (or host) has: naming the stage, the bytes needed and
            available, and the overrides that make it fit (or, when none does, the settings to lower); or the base's
            config.json lacks a size field (:func:`target_config_of`).
    """
    from medusa_train.planning.plan import find_fix

    run = plan_run(cfg, world_size)
    if isinstance(run, str):
        log.info("memory plan skipped: %s", run)
        return None
    plan = run.plan
    log.info("memory plan (%s; planned from shapes, not measured):\n%s", run.account, plan.table(terms=False))
    problems = plan.problems()
    if not problems:
        return plan
    stage, where, need, have = problems[0]
    fix = find_fix(run.target_config, cfg.heads, run.settings)
    if fix is None:
        advice = ("no trainer preset, heads.share_lm_head, smaller trainer.per_device_train_batch_size or "
                  "trainer.loss_chunk_size, or more GPUs fits: lower max_length or use devices with more memory")
    else:
        advice = f"set {' '.join(fix.changes)} (planned peak {fix.plan.peak_gpu_bytes / GIB:.2f} GiB per device)"
    raise ValueError(f"memory plan: stage {stage.name} needs {need:,} bytes ({need / GIB:.2f} GiB) per {where}, "
                     f"{have:,} bytes ({have / GIB:.2f} GiB) available ({run.account}); {advice}. The plan:\n"
                     f"{plan.table(terms=True)}")


__all__ = ["RunPlan", "check_run_memory", "devices_of", "host_ram_bytes", "plan_run", "target_config_of"]
