"""What a memory plan is computed for besides the models: the machine, the run's sizes and its trainer preset
(:class:`PlanSettings`), read from a :class:`~medusa_train.config.schema.TrainConfig` by :func:`settings_from_config` or
given by ``benchmarks/memory_plan.py``'s flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from medusa_train.config.schema import FROZEN_BASE, HEADS_MODES, JOINT, TrainConfig
from medusa_train.config.precision import choose_precision, parse_dtype

# trainer.strategy / trainer presets -> the ZeRO stage the plan divides by (0: every rank holds everything)
PRESET_STAGES = {"single": 0, "ddp": 0, "deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}


def dtype_bytes(name: str, field: str = "dtype") -> int:
    """Bytes per element of a dtype name (``bfloat16``, ``bf16``, ``float32`` ...).

    Raises:
        ValueError: an unknown name (``field`` named).
    """
    try:
        return parse_dtype(str(name).removeprefix("torch.")).itemsize
    except ValueError as e:
        raise ValueError(f"{field}={name!r}: {e}") from None


@dataclass(frozen=True)
class PlanSettings:
    """The machine and the run a plan is for.

    Attributes:
        gpus: ranks of the run (WORLD_SIZE), one GPU each.
        gpus_per_host: ranks on one host (LOCAL_WORLD_SIZE; at most 8 on the users' nodes).
        gpu_bytes: memory of one GPU (``total_memory``), bytes.
        host_bytes: RAM of one host, bytes; None: not checked.
        seq: tokens per sequence (``max_length``).
        batch: sequences per GPU per micro step (``trainer.per_device_train_batch_size``).
        base_dtype: the dtype the base loads in (``model.dtype``; ``bfloat16`` for a 70B).
        precision: the heads' training precision (``trainer.precision``: fp32, bf16, fp16).
        zero_stage: 0 (``single``/``ddp``: every rank holds the whole trainable state), 1, 2 or 3 (DeepSpeed's
            ``zero_optimization.stage``).
        loss_chunk_size: rows projected onto the vocabulary at once by the loss (``trainer.loss_chunk_size``;
            0: off, every row at once).
        recipe: ``heads.mode``: ``frozen_base`` or ``joint`` (:data:`~medusa_train.config.schema.HEADS_MODES`).
        hidden_cache: train from the hidden-state cache (``hidden_cache``): the cache is built first and the
            training stage keeps only the lm_head and embeddings of the base.
        base_placement: ``replicated``, ``zero3`` or ``auto`` (``base_placement``: a frozen base's placement while
            the cache is built or, without the cache, while training).
        self_distill: the run regenerates its data with vLLM first (``data.self_distill`` with engine ``vllm``).
        max_num_seqs: vLLM's concurrent sequences per engine (``data.generation_batch_size``).
        tokens: tokens the hidden cache stores (None: the disk term is not planned).
        lora_r: Medusa-2's LoRA rank (``heads.lora.r``); None: the base is fine-tuned fully
            (``heads.finetune=full``); 0: frozen.
        lora_targets: the LoRA target modules (None: ``q_proj, k_proj, v_proj, o_proj``).
        device_kind: ``cuda`` (a GPU per rank) or ``cpu`` (a CPU run: each rank's share of the host's RAM is its
            "device").
        gradient_checkpointing: Medusa-2's base keeps only its layers' inputs in the forward pass and recomputes the
            rest in the backward pass (``trainer.extra.gradient_checkpointing``).
        soft_targets: the heads learn the base's distribution (``heads.target=soft``): Medusa-2 then holds the
            base's logits at every position, whatever ``loss_chunk_size``.
        head_vocab_size etc. are the heads config's (:class:`~medusa_train.config.schema.HeadShape`), given beside these.
    """

    gpus: int
    gpu_bytes: int
    seq: int
    batch: int = 8
    gpus_per_host: int | None = None
    host_bytes: int | None = None
    base_dtype: str = "bfloat16"
    precision: str = "bf16"
    zero_stage: int = 0
    loss_chunk_size: int = 2048
    recipe: str = FROZEN_BASE
    hidden_cache: bool = True
    base_placement: str = "auto"
    self_distill: bool = False
    max_num_seqs: int = 16
    tokens: int | None = None
    lora_r: int | None = 16
    lora_targets: tuple[str, ...] | None = None
    device_kind: str = "cuda"
    gradient_checkpointing: bool = False
    soft_targets: bool = False

    def __post_init__(self) -> None:
        for name in ("gpus", "gpu_bytes", "seq", "batch", "max_num_seqs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"memory plan: {name} must be >= 1, got {getattr(self, name)}")
        if int(self.loss_chunk_size) < 0:
            raise ValueError(f"memory plan: loss_chunk_size must be >= 0 (0: off), got {self.loss_chunk_size}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"memory plan: zero_stage must be 0-3, got {self.zero_stage}")
        if self.device_kind not in ("cuda", "cpu"):
            raise ValueError(f"memory plan: device_kind must be cuda or cpu, got {self.device_kind!r}")
        if self.recipe not in HEADS_MODES:
            raise ValueError(f"memory plan: recipe must be one of {HEADS_MODES} (heads.mode), got {self.recipe!r}")
        dtype_bytes(self.base_dtype, "model.dtype")
        dtype_bytes(self.precision, "trainer.precision")

    @property
    def per_host(self) -> int:
        """Ranks per host: :attr:`gpus_per_host`, or all of them up to 8."""
        return self.gpus_per_host or min(self.gpus, 8)


def zero_stage_of(trainer: Any) -> int:
    """The ZeRO stage of a :class:`~medusa_train.config.schema.TrainerConfig`: 0 for ``single``/``ddp``, else the
    DeepSpeed config's ``zero_optimization.stage`` (the file read, nothing else)."""
    if trainer.strategy != "deepspeed":
        return 0
    from medusa_train.training.arguments import load_deepspeed_config

    return int(load_deepspeed_config(trainer.deepspeed)["zero_optimization"]["stage"])


def settings_from_config(cfg: TrainConfig, gpus: int, gpu_bytes: int, gpus_per_host: int | None = None,
                         host_bytes: int | None = None, base_dtype: str | None = None,
                         device_kind: str = "cuda") -> PlanSettings:
    """The :class:`PlanSettings` of a run's config on ``gpus`` devices of ``gpu_bytes`` each.

    Args:
        base_dtype: the dtype the base loads in (``model.dtype`` resolved: ``auto`` decided by the caller).
    """
    distill = cfg.data.self_distill and cfg.data.distill_engine == "vllm"
    finetune = cfg.heads.finetune
    lora_r = cfg.heads.lora.r if finetune == "lora" else (None if finetune == "full" else 0)
    hidden_cache = cfg.hidden_cache or (cfg.heads.mode == JOINT and cfg.heads.stage1_hidden_cache)
    return PlanSettings(
        gpus=gpus, gpu_bytes=gpu_bytes, gpus_per_host=gpus_per_host, host_bytes=host_bytes, seq=cfg.max_length,
        batch=cfg.trainer.per_device_train_batch_size, base_dtype=base_dtype or cfg.model.dtype,
        precision=choose_precision(cfg.trainer.precision, device_kind).precision,  # auto resolved as training does
        zero_stage=zero_stage_of(cfg.trainer),
        loss_chunk_size=cfg.trainer.loss_chunk_size, recipe=cfg.heads.mode, hidden_cache=hidden_cache,
        base_placement=cfg.base_placement, self_distill=distill, max_num_seqs=cfg.data.generation_batch_size,
        lora_r=lora_r, lora_targets=tuple(cfg.heads.lora.target_modules) if cfg.heads.lora.target_modules else None,
        device_kind=device_kind, gradient_checkpointing=bool(cfg.trainer.extra.get("gradient_checkpointing", False)),
        soft_targets=cfg.heads.target == "soft",
    )


__all__ = ["PRESET_STAGES", "PlanSettings", "dtype_bytes", "settings_from_config", "zero_stage_of"]
