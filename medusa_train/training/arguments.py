"""``trainer/`` config -> HF ``TrainingArguments``, with the checks that must fail before any process group or model.

Distributed layout comes from the launcher's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``: torchrun and the
deepspeed launcher both set them). DeepSpeed configs are read here so that batch sizes written in them are checked
against the trainer config (``train_batch_size == micro * accumulation * world size``) with the fields named,
instead of failing later inside DeepSpeed.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments

from medusa_train.config.schema import LoggerConfig, TrainerConfig
from medusa_train.files.paths import CONF_DIR, cache_dir
from medusa_train.config.precision import choose_precision
from medusa_train.training.process_group import start_cpu_group, timeout_seconds


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: global rank, local rank and world size (1 process by default)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``.

        Raises:
            ValueError: a variable that is not an integer, or a rank outside the world size.
        """
        try:
            env = cls(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                      int(os.environ.get("WORLD_SIZE", 1)))
        except ValueError as e:
            raise ValueError(f"RANK, LOCAL_RANK and WORLD_SIZE must be integers: {e}") from e
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
        return env

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_deepspeed_path(path: str) -> Path:
    """A DeepSpeed config path as given, relative to the working folder, or relative to ``conf/``.

    Raises:
        FileNotFoundError: found in none of these places.
    """
    candidates = [Path(path)] if Path(path).is_absolute() else [Path.cwd() / path, CONF_DIR / path]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(
        f"trainer.deepspeed={path!r} not found (looked in {[str(c) for c in candidates]}); give a JSON file path"
    )


def load_deepspeed_config(path: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON config.

    Raises:
        FileNotFoundError: see :func:`resolve_deepspeed_path`.
        ValueError: not a JSON object, or no ``zero_optimization.stage``.
    """
    file = resolve_deepspeed_path(path)
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {file} is not valid JSON: {e}") from e
    if not isinstance(config, dict) or "stage" not in config.get("zero_optimization", {}):
        raise ValueError(f"DeepSpeed config {file} needs a zero_optimization.stage")
    return config


def check_deepspeed_batch(config: dict[str, Any], trainer: TrainerConfig, world_size: int) -> None:
    """Check the batch sizes a DeepSpeed config states (``"auto"`` values are filled in by the Trainer).

    Raises:
        ValueError: ``train_micro_batch_size_per_gpu`` differs from ``trainer.per_device_train_batch_size``,
            ``gradient_accumulation_steps`` from ``trainer.gradient_accumulation_steps``, or ``train_batch_size``
            from micro batch * accumulation steps * world size; the message names each field and value.
    """
    micro, accum = trainer.per_device_train_batch_size, trainer.gradient_accumulation_steps

    def stated(key: str) -> int | None:
        value = config.get(key, "auto")
        return None if value == "auto" else int(value)

    ds_micro = stated("train_micro_batch_size_per_gpu")
    ds_accum = stated("gradient_accumulation_steps")
    ds_total = stated("train_batch_size")
    problems = []
    if ds_micro is not None and ds_micro != micro:
        problems.append(f"train_micro_batch_size_per_gpu={ds_micro} but trainer.per_device_train_batch_size={micro}")
    if ds_accum is not None and ds_accum != accum:
        problems.append(f"gradient_accumulation_steps={ds_accum} but trainer.gradient_accumulation_steps={accum}")
    if ds_total is not None and ds_total != micro * accum * world_size:
        problems.append(
            f"train_batch_size={ds_total} but train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
            f"world_size = {micro} * {accum} * {world_size} = {micro * accum * world_size}"
        )
    if problems:
        raise ValueError(
            "inconsistent batch sizes in the DeepSpeed config: " + "; ".join(problems)
            + ". Set them to \"auto\" (the Trainer fills them in) or make them agree."
        )


def check_strategy(trainer: TrainerConfig, env: DistEnv) -> None:
    """Raise ``ValueError`` when a one-process trainer config runs under a multi-process launcher."""
    if trainer.strategy == "single" and env.world_size > 1:
        raise ValueError(
            f"trainer.strategy=single but WORLD_SIZE={env.world_size}: under torchrun use trainer=ddp, "
            "trainer=deepspeed_zero2 or trainer=deepspeed_zero3"
        )


def training_device(trainer: TrainerConfig) -> str:
    """The device type a run trains on: ``cpu`` with ``trainer.use_cpu`` or without CUDA, else ``cuda``."""
    return "cpu" if trainer.use_cpu or not torch.cuda.is_available() else "cuda"


def training_arguments(
    trainer: TrainerConfig,
    logger: LoggerConfig,
    *,
    checkpoints_dir: Path,
    seed: int,
    deepspeed_config: dict[str, Any] | None,
    world_size: int = 1,
) -> TrainingArguments:
    """Build the Trainer's arguments (this sets up the process group under a launcher).

    A ``ddp`` trainer config started as one plain process (no launcher) trains as a single process.

    Rotation is not the Trainer's (``save_total_limit=None``): see :mod:`medusa_train.training.checkpoints`.
    """
    device = training_device(trainer)
    use_cpu = device == "cpu"
    precision = choose_precision(trainer.precision, device).precision  # auto: BaseRecipe resolved it already
    backend = trainer.ddp_backend or ("gloo" if use_cpu else "nccl")
    start_cpu_group(trainer.timeout_minutes, use_cpu, backend, world_size)  # HF gives a CPU group no timeout
    if deepspeed_config is not None:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    if "wandb" in logger.report_to:  # the HF WandbCallback reads these variables; the config is the source of truth
        os.environ["WANDB_PROJECT"] = logger.project
        os.environ["WANDB_DIR"] = str(checkpoints_dir.parent)  # runs go to ${output_dir}/wandb
        if logger.mode:
            os.environ["WANDB_MODE"] = logger.mode
        if logger.tags:
            os.environ["WANDB_TAGS"] = ",".join(logger.tags)
    kwargs: dict[str, Any] = dict(
        output_dir=str(checkpoints_dir),
        per_device_train_batch_size=trainer.per_device_train_batch_size,
        per_device_eval_batch_size=trainer.per_device_eval_batch_size,
        gradient_accumulation_steps=trainer.gradient_accumulation_steps,
        learning_rate=trainer.learning_rate,
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2,
        max_grad_norm=trainer.max_grad_norm,
        optim=trainer.optim,
        lr_scheduler_type=trainer.lr_scheduler_type,
        warmup_steps=trainer.warmup_ratio,  # a float in [0, 1) is a share of all steps
        num_train_epochs=trainer.num_train_epochs,
        max_steps=trainer.max_steps,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        logging_steps=trainer.logging_steps,
        save_strategy="steps",
        save_steps=trainer.save_steps,
        save_total_limit=None,
        eval_strategy="no",
        prediction_loss_only=True,
        label_names=["labels"],  # so that evaluation goes through compute_loss
        remove_unused_columns=False,
        average_tokens_across_devices=True,
        report_to=list(logger.report_to) or "none",
        run_name=logger.run_name,
        seed=seed,
        data_seed=seed,
        use_cpu=use_cpu,
        ddp_backend=backend if (world_size > 1 or deepspeed_config is not None) else None,
        ddp_find_unused_parameters=False,
        ddp_timeout=timeout_seconds(trainer.timeout_minutes),  # GPU groups; CPU ones: process_group.start_cpu_group
        deepspeed=deepspeed_config,
        dataloader_num_workers=trainer.dataloader_num_workers,
        disable_tqdm=trainer.disable_tqdm,
    )
    overlap = sorted(set(trainer.extra) & {"output_dir", "save_total_limit", "deepspeed", "remove_unused_columns"})
    if overlap:
        raise ValueError(f"trainer.extra may not set {overlap}: they are managed by medusa-train")
    kwargs.update(trainer.extra)
    return TrainingArguments(**kwargs)


@contextlib.contextmanager
def zero3_hidden_from_transformers(args: TrainingArguments) -> Iterator[None]:
    """Within the block, transformers does not see the Trainer's DeepSpeed ZeRO-3 config.

    The frozen base model lives outside the DeepSpeed engine (only the heads are sharded): without this,
    ``from_pretrained`` would partition it with ``deepspeed.zero.Init`` and ``generate`` (self-distillation) would
    step all ranks in lockstep (``synced_gpus``), which hangs when ranks have different numbers of prompts. The
    config is restored on exit, before the Trainer is built.
    """
    from medusa_train.training.base_placement import hf_deepspeed_config

    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is None:
        yield
        return
    with hf_deepspeed_config(None, hf_config):
        yield
