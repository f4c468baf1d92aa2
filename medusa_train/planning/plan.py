"""A run's memory plan (:func:`build_plan`) and, when it does not fit, the fewest setting changes that make it fit
(:func:`find_fix`).

The target is built on the ``meta`` device from its ``config.json`` and the drafter from ``heads.*`` through the
project's own classes (:mod:`.meta`); the stages' terms are :mod:`.stages`'. Nothing is loaded or allocated: a 70B
plan takes a few seconds on a CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from medusa_train.config.schema import FROZEN_BASE, JOINT
from medusa_train.planning.meta import HeadsSizes, TargetSizes, heads_sizes, target_sizes
from medusa_train.planning.settings import PlanSettings
from medusa_train.planning.stages import cache_build_stage, export_stage, self_distill_stage, training_stage
from medusa_train.planning.terms import MemoryPlan

# ZeRO stage -> the trainer preset (conf/trainer/) a fix names
PRESETS = {0: "ddp", 1: "deepspeed_zero1", 2: "deepspeed_zero2", 3: "deepspeed_zero3"}
FIX_PRESETS = (2, 3)  # the shipped DeepSpeed presets a fix may switch to (conf/trainer/deepspeed_zero{2,3}.yaml)
MAX_FIX_GPUS = 512  # the largest world size a fix proposes (64 nodes of 8)
# Among fixes of as many changes, those whose peak stays within this share of a device come first: the rest is left
# for what the plan does not count (planned, not measured).
FIX_HEADROOM = 0.9


def plan_from_sizes(target: TargetSizes, heads: HeadsSizes, s: PlanSettings,
                    summary: dict[str, Any] | None = None) -> MemoryPlan:
    """The plan of a run's stages: self-distillation (when ``s.self_distill``), the cache build (when
    ``s.hidden_cache``), training and export."""
    stages = []
    if s.self_distill:
        stages.append(self_distill_stage(target, s))
    if s.hidden_cache and s.recipe == FROZEN_BASE:
        stages.append(cache_build_stage(target, heads, s))
    stages += [training_stage(target, heads, s), export_stage(heads, s)]
    return MemoryPlan(stages=tuple(stages), gpus=s.gpus, gpus_per_host=s.per_host, gpu_capacity=s.gpu_bytes,
                      host_capacity=s.host_bytes, summary=summary or {},
                      device="CPU rank" if s.device_kind == "cpu" else "GPU")


def summary_of(target: TargetSizes, heads: HeadsSizes, heads_cfg: Any, s: PlanSettings) -> dict[str, Any]:
    """The figures a plan reports besides its stages: parameter counts and the settings planned with."""
    return {"target_params": target.params, "heads_params": heads.params, "head_type": heads.head_type,
            "share_lm_head": bool(heads_cfg.share_lm_head), "head_vocab_size": heads_cfg.head_vocab_size,
            "trainer": PRESETS[s.zero_stage], "precision": s.precision, "seq": s.seq, "batch": s.batch,
            "loss_chunk_size": s.loss_chunk_size, "recipe": s.recipe}


def build_plan(target_config: Any, heads_cfg: Any, s: PlanSettings) -> MemoryPlan:
    """The memory plan of training ``heads_cfg`` (``heads.*``) for the target ``target_config`` (a transformers
    ``PretrainedConfig``) under ``s``.

    Raises:
        ValueError: head settings the drafter refuses (the field named).
    """
    target = target_sizes(target_config)
    heads = heads_sizes(heads_cfg, target_config, target)
    return plan_from_sizes(target, heads, s, summary_of(target, heads, heads_cfg, s))


@dataclass(frozen=True)
class Fix:
    """Setting changes that make a plan fit.

    Attributes:
        changes: ``key=value`` overrides of ``medusa-train`` (``trainer=deepspeed_zero2``), and ``WORLD_SIZE=N``
            where the run needs N GPUs (the launcher's setting: ``torchrun --nnodes`` x ``--nproc_per_node``).
        plan: the plan with them.
    """

    changes: tuple[str, ...]
    plan: MemoryPlan


def _halvings(value: int, floor: int) -> list[int]:
    out = [value]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    return out


FIX_ORDER = ("WORLD_SIZE", "trainer", "+trainer.extra.gradient_checkpointing", "heads.share_lm_head",
             "trainer.per_device_train_batch_size", "trainer.loss_chunk_size")  # which change a fix prefers, among fixes of as many changes


def _priority(change: str) -> int:
    return FIX_ORDER.index(change.split("=", 1)[0])


def find_fix(target_config: Any, heads_cfg: Any, s: PlanSettings) -> Fix | None:
    """The fewest changes among a DeepSpeed preset (:data:`FIX_PRESETS`), ``heads.share_lm_head=true`` (heads
    that can share it), gradient checkpointing of Medusa-2's base, halving ``trainer.per_device_train_batch_size``
    down to 1 and ``trainer.loss_chunk_size``
    down to 256, that make the plan fit on these GPUs; failing that, the smallest power-of-two number of GPUs
    (up to :data:`MAX_FIX_GPUS`) that fits with ZeRO-3 and the fewest other changes. None: nothing fits.
    Fewer changes first, then those leaving :data:`FIX_HEADROOM` of a device free, then the order listed (a preset
    before sharing the lm_head before a smaller batch)."""
    target = target_sizes(target_config)
    sized = {heads_cfg.share_lm_head: heads_sizes(heads_cfg, target_config, target)}
    if not heads_cfg.share_lm_head:
        try:  # heads that cannot share the base lm_head (their spec refuses it) are planned as they are
            sized[True] = heads_sizes(dataclasses.replace(heads_cfg, share_lm_head=True), target_config, target)
        except ValueError:
            pass
    share_options = list(sized)
    presets = [s.zero_stage, *(z for z in FIX_PRESETS if z > s.zero_stage)]
    batches = _halvings(s.batch, 1)
    chunks = _halvings(s.loss_chunk_size, 256) if s.loss_chunk_size else [0, 2048]  # off: turning it on is a fix
    checkpointing = [s.gradient_checkpointing] + ([True] if s.recipe == JOINT and not s.gradient_checkpointing
                                                  else [])

    def attempt(gpus: int, zero: int, share: bool, batch: int, chunk: int, ckpt: bool) -> Fix:
        changes = []
        if gpus != s.gpus:
            changes.append(f"WORLD_SIZE={gpus}")  # the launcher's: torchrun --nnodes x --nproc_per_node
        if zero != s.zero_stage:
            changes.append(f"trainer={PRESETS[zero]}")
        if ckpt != s.gradient_checkpointing:
            changes.append("+trainer.extra.gradient_checkpointing=true")
        if share != heads_cfg.share_lm_head:
            changes.append("heads.share_lm_head=true")
        if batch != s.batch:
            changes.append(f"trainer.per_device_train_batch_size={batch}")
        if chunk != s.loss_chunk_size:
            changes.append(f"trainer.loss_chunk_size={chunk}")
        new = dataclasses.replace(s, gpus=gpus, zero_stage=zero, batch=batch, loss_chunk_size=chunk,
                                  gradient_checkpointing=ckpt)
        cfg = dataclasses.replace(heads_cfg, share_lm_head=share)
        return Fix(tuple(changes), plan_from_sizes(target, sized[share], new, summary_of(target, sized[share], cfg,
                                                                                           new)))

    world = [s.gpus] + [g for g in (2**i for i in range(1, 10)) if s.gpus < g <= MAX_FIX_GPUS]
    for gpus in world:
        zeros = presets if gpus == s.gpus else [3]
        fits = [f for f in (attempt(gpus, *c) for c in itertools.product(zeros, share_options, batches, chunks,
                                                                                checkpointing))
                if f.plan.fits]
        if fits:
            return min(fits, key=lambda f: (len(f.changes), f.plan.peak_gpu_bytes > FIX_HEADROOM * f.plan.gpu_capacity,
                                            sorted(map(_priority, f.changes))))
    return None


__all__ = ["FIX_HEADROOM", "FIX_PRESETS", "Fix", "MAX_FIX_GPUS", "PRESETS", "build_plan", "find_fix", "plan_from_sizes", "summary_of"]
