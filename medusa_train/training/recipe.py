"""The Medusa-1 training recipe: ``setup`` -> ``train`` -> ``save`` -> ``cleanup`` (torchtune's recipe interface).

Everything that can be checked without a model is checked first, on every rank: config values, the launcher's world
size against the trainer strategy, DeepSpeed batch sizes, and whether ``output_dir`` holds another run. Then the
process group starts (through ``TrainingArguments``), the base model loads (converted once, main process first), the
data is prepared (self-distillation sharded over ranks), the heads are built from the base lm_head, and the HF Trainer
trains them (:class:`~medusa_train.training.trainer.MedusaTrainer`). At the end every rank joins in gathering the
heads' full fp32 weights (sharded under ZeRO-3); the main process measures per-head accuracy on the held-out split,
prints the table and writes ``export/`` with ``train_head_accuracy.json``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import TrainerCallback, set_seed

from medusa_train.config import TrainConfig, as_dataclass
from medusa_train.data import Collator
from medusa_train.export import save_export
from medusa_train.heads import MedusaHeads, build_token_map
from medusa_train.loading.base import load_base_model
from medusa_train.loading.medusa import export_extra_config
from medusa_train.model import check_supported, new_heads_for
from medusa_train.training import checkpoints
from medusa_train.training.arguments import (
    DistEnv,
    check_deepspeed_batch,
    check_strategy,
    load_deepspeed_config,
    training_arguments,
    zero3_hidden_from_transformers,
)
from medusa_train.training.callbacks import exit_callback_from_env
from medusa_train.training.data_prep import PreparedData, prepare_data
from medusa_train.training.evaluate import head_accuracy
from medusa_train.training.hidden_cache import (
    CachedHiddenDataset,
    HiddenCollator,
    build_hidden_cache,
    dataset_fingerprint,
)
from medusa_train.training.metrics import format_table
from medusa_train.training.run_dir import RunPaths, check_output_dir, prepare_output_dir
from medusa_train.training.step import FrozenBase, LossSpec
from medusa_train.training.trainer import MedusaTrainer

log = logging.getLogger(__name__)

ACCURACY_FILE = "train_head_accuracy.json"


def resolve_config(cfg: TrainConfig | DictConfig | dict[str, Any]) -> tuple[TrainConfig, dict[str, Any]]:
    """A validated :class:`TrainConfig` and its resolved plain-dict form (Hydra's own ``hydra`` node dropped).

    Raises:
        ValueError: a value that fails validation (the field is named).
    """
    if isinstance(cfg, TrainConfig):
        node = OmegaConf.structured(cfg)
    else:
        given = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
        node = OmegaConf.merge(OmegaConf.structured(TrainConfig), given)
    resolved = OmegaConf.to_container(node, resolve=True)
    resolved.pop("hydra", None)
    return as_dataclass(TrainConfig, resolved), resolved


def gather_heads_state(trainer: MedusaTrainer) -> dict[str, torch.Tensor]:
    """Full fp32 weights and buffers of the trained heads, on the CPU, on every rank (collective under DeepSpeed).

    Under ZeRO-3 the parameters are sharded and under ZeRO-1/2 with bf16/fp16 the module holds low-precision copies;
    ``safe_get_full_fp32_param`` assembles the optimizer's fp32 master weights in both cases.
    """
    heads = trainer.model
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, param in heads.named_parameters():
            full = safe_get_full_fp32_param(param)
            state[name] = (full if full is not None else param.data).detach().float().cpu().clone()
        state.update({name: buf.detach().cpu().clone() for name, buf in heads.named_buffers()})
        return state
    return {k: v.detach().cpu().clone() for k, v in heads.state_dict().items()}


class TrainRecipe:
    """One training run.

    Args:
        cfg: the composed config (``TrainConfig``, Hydra ``DictConfig`` or a plain dict of the same shape).
        callbacks: extra ``TrainerCallback`` objects (tests, custom logging).

    Raises:
        ValueError: invalid settings, found before anything is loaded.
    """

    def __init__(self, cfg: TrainConfig | DictConfig | dict[str, Any], callbacks: Sequence[TrainerCallback] = ()):
        self.cfg, self.resolved = resolve_config(cfg)
        self.extra_callbacks = list(callbacks)
        self.env = DistEnv.from_environ()
        self.paths = RunPaths(Path(self.cfg.output_dir).resolve())
        self.trainer: MedusaTrainer | None = None
        self.summary: dict[str, Any] = {}

    # ---- setup ---------------------------------------------------------------------------------------------------

    def check(self) -> dict[str, Any] | None:
        """The checks that need no model (every rank, read-only); returns the DeepSpeed config, if any."""
        cfg = self.cfg
        check_strategy(cfg.trainer, self.env)
        ds_config = None
        if cfg.trainer.strategy == "deepspeed":
            ds_config = load_deepspeed_config(cfg.trainer.deepspeed)
            check_deepspeed_batch(ds_config, cfg.trainer, self.env.world_size)
        check_output_dir(self.paths, self.resolved, cfg.resume, cfg.overwrite)
        if cfg.push_to_hub:
            from medusa_train.publish import check_publish_ready

            check_publish_ready(cfg.hub_repo_id)  # repo name, offline mode and token, before any model loads
        return ds_config

    def setup(self) -> None:
        """Checks, process group, base model, data, heads, optional hidden cache, Trainer."""
        cfg = self.cfg
        ds_config = self.check()
        args = training_arguments(cfg.trainer, cfg.logger, checkpoints_dir=self.paths.checkpoints, seed=cfg.seed,
                                  deepspeed_config=ds_config, world_size=self.env.world_size)
        device = args.device  # starts the process group under a launcher
        from accelerate import PartialState

        self.barrier = PartialState().wait_for_everyone
        if self.env.is_main:
            prepare_output_dir(self.paths, self.resolved, cfg.overwrite)
        self.barrier()
        set_seed(cfg.seed)

        with zero3_hidden_from_transformers(args):
            with args.main_process_first(desc="load the base model"):  # converts GGUF/llama2.c once, into the cache
                model_device = "cpu" if device.type == "cpu" else str(device)  # the trainer's (cuda:LOCAL_RANK)
                base, tokenizer = load_base_model(dataclasses.replace(cfg.model, device=model_device))
            check_supported(base)
            self.base = base
            data = prepare_data(
                cfg.data, tokenizer=tokenizer, model=base, max_length=cfg.max_length, seed=cfg.seed,
                self_distill_dir=Path(cfg.data.self_distill_dir or self.paths.self_distill),
                rank=self.env.rank, world_size=self.env.world_size, barrier=self.barrier,
            )
        heads = self._new_heads(base, data)
        vocab_size = int(base.get_output_embeddings().weight.shape[0])
        self.loss_spec = LossSpec(target=cfg.heads.target, decay=cfg.heads.loss_decay,
                                  share_lm_head=cfg.heads.share_lm_head, vocab_size=vocab_size,
                                  token_map=None if heads.token_map is None else heads.token_map.to(device))
        self.frozen_base = FrozenBase.of(base)
        self.collator: Any = Collator.from_tokenizer(tokenizer)
        train_set, eval_set = data.train, data.eval
        if cfg.hidden_cache:
            train_set, eval_set = self._cached_datasets(data, device, args.per_device_eval_batch_size)
        self.eval_set = eval_set
        self.data = data

        callbacks = [*self.extra_callbacks]
        exit_cb = exit_callback_from_env()
        if exit_cb is not None:
            callbacks.append(exit_cb)
        self.trainer = MedusaTrainer(
            model=heads, args=args, train_dataset=train_set, eval_dataset=eval_set if len(eval_set) else None,
            data_collator=self.collator, callbacks=callbacks, frozen_base=self.frozen_base,
            loss_spec=self.loss_spec, keep_checkpoints=cfg.trainer.save_total_limit,
        )

    def _new_heads(self, base: Any, data: PreparedData) -> MedusaHeads:
        hc = self.cfg.heads
        token_map = None
        if hc.head_vocab_size is not None:
            vocab_size = int(base.get_output_embeddings().weight.shape[0])
            counts = torch.zeros(vocab_size, dtype=torch.long)
            for labels in data.train["labels"]:
                ids = torch.as_tensor(labels, dtype=torch.long)
                counts += torch.bincount(ids[ids >= 0], minlength=vocab_size)
            token_map = build_token_map(counts, hc.head_vocab_size)
        return new_heads_for(base, hc.medusa_num_heads, hc.medusa_num_layers, hc.share_lm_head, token_map)

    def _cached_datasets(self, data: PreparedData, device: torch.device, batch_size: int) -> tuple[Any, Any]:
        """Build this rank's cache shards, wait for all ranks, and read every shard back; drop the backbone."""
        folder = Path(self.cfg.hidden_cache_dir or self.paths.hidden_cache)
        dtype = self.base.get_output_embeddings().weight.dtype
        out = []
        fingerprints = {}
        for split, dataset in (("train", data.train), ("eval", data.eval)):
            fingerprints[split] = dataset_fingerprint(dataset, self.cfg.model.name_or_path, dtype)
            build_hidden_cache(self.frozen_base, dataset, folder, split=split, fingerprint=fingerprints[split],
                               collator=self.collator, batch_size=batch_size, rank=self.env.rank,
                               world_size=self.env.world_size, device=device)
        self.barrier()
        for split, dataset in (("train", data.train), ("eval", data.eval)):
            out.append(CachedHiddenDataset(dataset, folder, split=split, fingerprint=fingerprints[split],
                                           world_size=self.env.world_size))
        self.frozen_base = FrozenBase.of(self.base, keep_backbone=False)
        self.collator = HiddenCollator()
        return out[0], out[1]

    # ---- train ---------------------------------------------------------------------------------------------------

    def train(self) -> None:
        """Train, from the latest complete checkpoint when ``resume=true``."""
        resume_from = None
        if self.cfg.resume:
            latest = checkpoints.latest_complete(self.paths.checkpoints)
            if latest is None:
                log.warning("resume=true but %s holds no complete checkpoint: starting from step 0",
                            self.paths.checkpoints)
            else:
                log.info("resuming from %s", latest)
                resume_from = str(latest)
        result = self.trainer.train(resume_from_checkpoint=resume_from)
        self.summary.update(global_step=result.global_step, train_loss=result.training_loss,
                            train_metrics=result.metrics, resumed_from=resume_from)

    # ---- save ----------------------------------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Gather the heads (every rank), then on the main process: accuracy table, export. Returns ``export/``."""
        state = gather_heads_state(self.trainer)
        export_dir = None
        if self.env.is_main:
            spec = self.trainer.model.spec
            token_map = state.get("token_map")
            heads = MedusaHeads(spec, token_map=token_map)
            heads.load_state_dict(state, strict=True)
            device = self.trainer.args.device
            heads.to(device)
            table = None
            if len(self.eval_set):
                table = head_accuracy(heads, self.frozen_base, self.eval_set, self.collator, self.loss_spec,
                                      self.trainer.args.per_device_eval_batch_size, device)
                print(f"per-head accuracy on the eval split ({len(self.eval_set)} conversations, "
                      f"target {self.cfg.heads.target}):\n{format_table(table)}", flush=True)
            else:
                log.warning("data.eval_fraction=0: no held-out conversations, no accuracy table")
            self.summary["accuracy"] = table
            if self.cfg.export:
                export_dir = self._export(heads.cpu(), table)
                self.summary["export_dir"] = str(export_dir)
                if self.cfg.push_to_hub:
                    self._publish(export_dir)
        self.barrier()
        return export_dir

    def _export(self, heads: MedusaHeads, table: dict[str, Any] | None) -> Path:
        cfg = self.cfg
        training = {"target": cfg.heads.target, "loss_decay": cfg.heads.loss_decay, "data_source": cfg.data.source,
                    "self_distill": cfg.data.self_distill, "max_length": cfg.max_length,
                    "global_step": self.summary.get("global_step"), "seed": cfg.seed}
        # The model/ config is recorded so tune-tree, eval and generate rebuild a GGUF or llama2.c base exactly.
        extra = {"training": training, **export_extra_config(cfg.model)}
        out = save_export(heads, self.paths.export, cfg.model.name_or_path, extra_config=extra,
                          vllm=cfg.export_vllm, base_model=self.base)
        if table is not None:
            record = {"split": "eval", "conversations": len(self.eval_set), "target": cfg.heads.target, **table}
            tmp = out / f".{ACCURACY_FILE}.tmp"
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, out / ACCURACY_FILE)
        log.info("exported heads to %s", out)
        return out

    def _publish(self, export_dir: Path) -> None:
        """Upload the export (main process only); a failure keeps the export and says how to retry."""
        from medusa_train.publish import PublishError, publish_export

        cfg = self.cfg
        try:
            result = publish_export(export_dir, cfg.hub_repo_id, private=cfg.hub_private, revision=cfg.hub_revision)
        except PublishError as e:
            raise PublishError(f"{e}\nThe export is saved in {export_dir}; retry with "
                               f"`medusa-publish export_dir={export_dir} repo_id={cfg.hub_repo_id}`") from None
        self.summary["hub_url"] = result.url

    # ---- cleanup -------------------------------------------------------------------------------------------------

    def cleanup(self, failed: bool = False) -> None:
        """Close the tracker run and the process group (without waiting for other ranks when this one ``failed``)."""
        if "wandb" in self.cfg.logger.report_to:
            import wandb

            if wandb.run is not None:
                wandb.finish(exit_code=1 if failed else 0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if not failed:
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def run(self) -> dict[str, Any]:
        """setup, train, save, cleanup; returns a summary (global_step, train_loss, accuracy, export_dir)."""
        try:
            self.setup()
            self.train()
            self.save()
        except BaseException:
            self.cleanup(failed=True)
            raise
        self.cleanup()
        return self.summary
