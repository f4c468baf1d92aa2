"""The training recipe: ``setup`` -> ``train`` -> ``save`` -> ``cleanup`` (torchtune's recipe interface).

``heads.mode=medusa1`` trains heads on a frozen base (below). ``heads.mode=medusa2`` first runs a Medusa-1 stage 1
when ``heads.stage1_epochs > 0`` (:mod:`medusa_train.training.stages`), then trains the base (LoRA, full or frozen,
:mod:`medusa_train.training.joint`) together with the heads (:class:`~medusa_train.training.joint_trainer.JointTrainer`)
and exports the heads with the fine-tuned base merged into ``export/base``.

Everything that can be checked without a model is checked first, on every rank, reading only: config values, the
launcher's world size against the trainer strategy, DeepSpeed batch sizes, the data files, ``output_dir`` itself
(not empty, not a file, not someone else's folder) and whether it holds another run, or a run that ``resume=true``
cannot continue with this config (:mod:`~medusa_train.training.run_dir`). Then the main process takes the folder's
lock (:mod:`~medusa_train.training.run_lock`), the process group starts (through ``TrainingArguments``), the base
model loads (converted once, main process first), the data is prepared (self-distillation sharded over ranks) and
refused if too little is left, and the heads are built from the base lm_head. Only then is the folder changed: an
overwritten run cleared, unusable checkpoints dropped, ``train_config.yaml`` written. The HF Trainer trains the heads
(:class:`~medusa_train.training.trainer.MedusaTrainer`, which stops on a non-finite loss or weight and on a diverged
head). At the end every rank joins in gathering the heads' full fp32 weights (sharded under ZeRO-3) and checks them
finite; the main process measures per-head accuracy on the held-out split, prints the table and writes ``export/``
with ``train_head_accuracy.json``. The lock is released on the way out, whether the run succeeded or failed.
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
from medusa_train.export import BASE_DIR, load_heads, save_base_model, save_export
from medusa_train.export.configs import export_head_type
from medusa_train.head_types import DRAFT_HEADS, DraftHeads, expect_head_type, heads_from_spec
from medusa_train.heads import MedusaHeads, build_token_map
from medusa_train.loading.base import load_base_model
from medusa_train.loading.medusa import ORIGINAL_BASE_KEY, check_export_base, export_extra_config
from medusa_train.model import check_heads_match_base, check_supported, new_heads_for
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
from medusa_train.training.data_prep import PreparedData, check_data_source, check_enough_data, prepare_data
from medusa_train.training.head_accuracy import head_accuracy
from medusa_train.training.hidden_cache import (
    CachedHiddenDataset,
    HiddenCollator,
    build_hidden_cache,
    dataset_fingerprint,
)
from medusa_train.training.metrics import format_table
from medusa_train.training.run_dir import RunPaths, check_location, check_output_dir, prepare_output_dir
from medusa_train.training.run_lock import RunLock, check_token
from medusa_train.training.joint import JointMedusaModel, causal_lm, lora_target_modules, prepare_base
from medusa_train.training.joint_trainer import JointSpec, JointTrainer, load_trainable_state
from medusa_train.training.stages import STAGE1_DIR, stage1_config, stage1_done
from medusa_train.training.step import FrozenBase, LossSpec
from medusa_train.training.trainer import MedusaTrainer, TrainingStopped, nonfinite_names

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


def gather_trainable_state(trainer: MedusaTrainer) -> dict[str, torch.Tensor]:
    """Full fp32 trained weights (parameters that require grad: the heads, and Medusa-2's adapters or base) and the
    heads' buffers, on the CPU, on every rank (collective under DeepSpeed); names as in ``trainer.model``.

    Under ZeRO-3 the parameters are sharded and under ZeRO-1/2 with bf16/fp16 the module holds low-precision copies;
    ``safe_get_full_fp32_param`` assembles the optimizer's fp32 master weights in both cases. Frozen base weights are
    not gathered: they are the base model's, reloaded from its files where needed.
    """
    model = trainer.model
    buffers = {}
    for prefix, module in model.named_modules():
        if isinstance(module, DRAFT_HEADS):
            for name, buf in module.named_buffers():
                buffers[f"{prefix}.{name}" if prefix else name] = buf.detach().cpu().clone()
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                full = safe_get_full_fp32_param(param)
                state[name] = (full if full is not None else param.data).detach().float().cpu().clone()
        return {**state, **buffers}
    state = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {**state, **buffers}



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
        self.joint = self.cfg.heads.mode == "medusa2"
        self.init_heads_from: Path | None = Path(self.cfg.heads.init_from) if self.cfg.heads.init_from else None
        self.lock: RunLock | None = None

    # ---- setup ---------------------------------------------------------------------------------------------------

    def check(self) -> dict[str, Any] | None:
        """The checks that need no model (every rank, read-only); returns the DeepSpeed config, if any."""
        cfg = self.cfg
        check_location(cfg.output_dir)
        check_strategy(cfg.trainer, self.env)
        ds_config = None
        if cfg.trainer.strategy == "deepspeed":
            ds_config = load_deepspeed_config(cfg.trainer.deepspeed)
            check_deepspeed_batch(ds_config, cfg.trainer, self.env.world_size)
        check_data_source(cfg.data)
        check_output_dir(self.paths, self.resolved, cfg.resume, cfg.overwrite, self.env.world_size)
        if cfg.export and cfg.export_vllm and cfg.heads.head_type == "hydra" and self.env.is_main:
            log.warning("export_vllm=true is skipped for Hydra heads: vLLM's Medusa loader reads Medusa heads only "
                        "(set export_vllm=false to silence this)")
        if self.joint:
            self._check_joint(ds_config)
        return ds_config

    def _check_joint(self, ds_config: dict[str, Any] | None) -> None:
        """Medusa-2 checks that need no model: heads to start from (``heads.init_from``) made for this base."""
        hc = self.cfg.heads
        if hc.init_from:
            config = check_export_base(hc.init_from, self.cfg.model, "heads.init_from")
            expect_head_type(export_head_type(config), "medusa", f"heads.init_from={hc.init_from}")
        zero3 = ds_config is not None and ds_config["zero_optimization"]["stage"] == 3
        if zero3 and hc.share_lm_head:
            raise ValueError("heads.share_lm_head=true with heads.mode=medusa2 under ZeRO-3: the heads would read the "
                             "sharded lm_head weight outside its module; use heads.share_lm_head=false or ZeRO-2")

    def hold(self) -> dict[str, Any] | None:
        """Main process: take ``output_dir``'s lock (once the folder passes :func:`check_location`), then
        :meth:`check` under it, so that the folder cannot change between the checks and the run; other ranks:
        :meth:`check`. Returns the DeepSpeed config. A failed check releases the lock, leaving the folder as it was
        (one created for the lock is removed again).

        Raises:
            LockHeldError: another run holds the folder (named), see :class:`RunLock`.
        """
        if self.env.is_main and self.lock is None:
            check_location(self.cfg.output_dir)
            self.lock = RunLock.acquire(self.paths.root)
        try:
            return self.check()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Release ``output_dir``'s lock, if this process holds it (idempotent; see :meth:`RunLock.release`)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _check_lock_shared(self) -> None:
        """Under a launcher: every rank sees the lock its main process holds (one run, one shared folder)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        token = [self.lock.holder.token if self.lock is not None else None]
        torch.distributed.broadcast_object_list(token, src=0)
        if not self.env.is_main:
            check_token(self.paths.root, token[0])

    def setup(self) -> None:
        """Checks and the folder's lock, process group, base model, data, heads, optional hidden cache, then the
        folder is prepared and the Trainer built."""
        cfg = self.cfg
        ds_config = self.hold()
        args = training_arguments(cfg.trainer, cfg.logger, checkpoints_dir=self.paths.checkpoints, seed=cfg.seed,
                                  deepspeed_config=ds_config, world_size=self.env.world_size)
        device = args.device  # starts the process group under a launcher
        from accelerate import PartialState

        self.barrier = PartialState().wait_for_everyone
        self._check_lock_shared()
        set_seed(cfg.seed)

        with zero3_hidden_from_transformers(args):
            with args.main_process_first(desc="load the base model"):  # converts GGUF/llama2.c once, into the cache
                model_device = "cpu" if device.type == "cpu" else str(device)  # the trainer's (cuda:LOCAL_RANK)
                base, tokenizer = load_base_model(dataclasses.replace(cfg.model, device=model_device))
            check_supported(base)
            if self.joint and cfg.heads.finetune == "lora":
                lora_target_modules(base, cfg.heads.lora.target_modules)  # fail before the data is prepared
            self.base = base
            self.tokenizer = tokenizer
            data = prepare_data(
                cfg.data, tokenizer=tokenizer, model=base, max_length=cfg.max_length, seed=cfg.seed,
                self_distill_dir=Path(cfg.data.self_distill_dir or self.paths.self_distill),
                rank=self.env.rank, world_size=self.env.world_size, barrier=self.barrier, model_config=cfg.model,
            )
        check_enough_data(data, cfg.heads.medusa_num_heads, cfg.trainer, self.env.world_size)
        heads = self._initial_heads(base) if self.init_heads_from else self._new_heads(base, data)
        vocab_size = int(base.get_output_embeddings().weight.shape[0])
        self.loss_spec = LossSpec(target=cfg.heads.target, decay=cfg.heads.loss_decay,
                                  share_lm_head=cfg.heads.share_lm_head, vocab_size=vocab_size,
                                  num_heads=heads.spec.num_heads,
                                  token_map=None if heads.token_map is None else heads.token_map.to(device),
                                  head_type=heads.spec.head_type)
        self.frozen_base = None if self.joint else FrozenBase.of(base)
        self.collator: Any = Collator.from_tokenizer(tokenizer)
        train_set, eval_set = data.train, data.eval
        if cfg.hidden_cache:
            train_set, eval_set = self._cached_datasets(data, device, args.per_device_eval_batch_size)
        self.eval_set = eval_set
        self.data = data
        if self.env.is_main:  # the run is known to start: only now is the folder changed
            prepare_output_dir(self.paths, self.resolved, cfg.overwrite, resume=cfg.resume)
        self.barrier()

        callbacks = [*self.extra_callbacks]
        exit_cb = exit_callback_from_env()
        if exit_cb is not None:
            callbacks.append(exit_cb)
        common = dict(args=args, train_dataset=train_set, eval_dataset=eval_set if len(eval_set) else None,
                      data_collator=self.collator, callbacks=callbacks, loss_spec=self.loss_spec,
                      keep_checkpoints=cfg.trainer.save_total_limit)
        if self.joint:
            hc = cfg.heads
            joint_spec = JointSpec(base_loss=cfg.base_loss, medusa_loss_weight=hc.medusa_loss_weight,
                                   loss_ramp=hc.loss_ramp, ramp_steps=hc.ramp_steps, ramp_ratio=hc.ramp_ratio,
                                   heads_lr_multiplier=hc.heads_lr_multiplier)
            model = JointMedusaModel(prepare_base(base, hc), heads)
            self.trainer = JointTrainer(model=model, joint_spec=joint_spec, **common)
        else:
            self.trainer = MedusaTrainer(model=heads, frozen_base=self.frozen_base, **common)

    def _initial_heads(self, base: Any) -> MedusaHeads:
        """Heads to start the joint stage from (``heads.init_from`` or stage 1's export), checked against the base
        and ``heads/``.

        Raises:
            ValueError: made for another base (hidden size, vocabulary), or a shape other than ``heads/`` asks for.
        """
        hc = self.cfg.heads
        source = self.init_heads_from
        heads, _ = load_heads(source, base_model=base, head_type="medusa")
        check_heads_match_base(heads.spec, base)
        asked = {"medusa_num_heads": hc.medusa_num_heads, "medusa_num_layers": hc.medusa_num_layers,
                 "share_lm_head": hc.share_lm_head, "head_vocab_size": hc.head_vocab_size}
        found = {"medusa_num_heads": heads.spec.num_heads, "medusa_num_layers": heads.spec.num_layers,
                 "share_lm_head": heads.spec.share_lm_head, "head_vocab_size": heads.spec.head_vocab_size}
        differ = [f"heads.{k}={asked[k]} (the export has {found[k]})" for k in asked if asked[k] != found[k]]
        if differ:
            raise ValueError(f"heads in {source} do not have the shape heads/ asks for: {', '.join(differ)}; "
                             "set these to the export's values")
        log.info("joint stage starts from the heads in %s", source)
        return heads.to(device=base.get_output_embeddings().weight.device, dtype=torch.float32)

    def _new_heads(self, base: Any, data: PreparedData) -> DraftHeads:
        hc = self.cfg.heads
        token_map = None
        if hc.head_vocab_size is not None:
            vocab_size = int(base.get_output_embeddings().weight.shape[0])
            counts = torch.zeros(vocab_size, dtype=torch.long)
            for labels in data.train["labels"]:
                ids = torch.as_tensor(labels, dtype=torch.long)
                counts += torch.bincount(ids[ids >= 0], minlength=vocab_size)
            token_map = build_token_map(counts, hc.head_vocab_size)
        return new_heads_for(base, hc.medusa_num_heads, hc.medusa_num_layers, hc.share_lm_head, token_map,
                             head_type=hc.head_type, combine=hc.combine)

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
        """Gather the trained weights (every rank), then on the main process: (Medusa-2: the fine-tuned base,
        merged), accuracy table, export. Returns ``export/``."""
        state = gather_trainable_state(self.trainer)
        bad = nonfinite_names(state.items())  # every rank holds the gathered state: all stop together
        if bad:
            raise TrainingStopped(f"the trained weights are not finite ({', '.join(bad[:4])}): nothing is exported; "
                                  "lower trainer.learning_rate and start again with overwrite=true")
        export_dir = None
        if self.env.is_main:
            spec = self.trainer.model.spec
            heads_state = state
            frozen_base = self.frozen_base
            if self.joint:
                heads_state = {k.removeprefix("heads."): v for k, v in state.items() if k.startswith("heads.")}
                self.trained_base = self._trained_base(
                    {k.removeprefix("base."): v for k, v in state.items() if k.startswith("base.")})
                frozen_base = FrozenBase.of(self.trained_base)
            token_map = heads_state.get("token_map")
            heads = heads_from_spec(spec, token_map=token_map)
            heads.load_state_dict(heads_state, strict=True)
            device = self.trainer.args.device
            heads.to(device)
            table = None
            if len(self.eval_set):
                table = head_accuracy(heads, frozen_base, self.eval_set, self.collator, self.loss_spec,
                                      self.trainer.args.per_device_eval_batch_size, device)
                print(f"per-head accuracy on the eval split ({len(self.eval_set)} conversations, "
                      f"target {self.cfg.heads.target}):\n{format_table(table)}", flush=True)
            else:
                log.warning("data.eval_fraction=0: no held-out conversations, no accuracy table")
            self.summary["accuracy"] = table
            if self.cfg.export:
                export_dir = self._export(heads.cpu(), table)
                self.summary["export_dir"] = str(export_dir)
        self.barrier()
        return export_dir

    def _trained_base(self, base_state: dict[str, torch.Tensor]) -> Any:
        """Main process: the base model as trained, as a plain ``*ForCausalLM`` (LoRA merged), on the training device.

        Built from a fresh load of ``model/`` (outside any ZeRO-3 partitioning) with the gathered trained weights
        copied in, so one path serves every strategy; this holds a second copy of the base in memory for a moment.
        """
        cfg = self.cfg
        device = self.trainer.args.device
        model_device = "cpu" if device.type == "cpu" else str(device)
        with zero3_hidden_from_transformers(self.trainer.args):
            fresh, _ = load_base_model(dataclasses.replace(cfg.model, device=model_device))
        if cfg.heads.finetune == "frozen":
            return fresh
        trainable = prepare_base(fresh, cfg.heads)
        load_trainable_state(trainable, base_state, "the trained base weights")
        merged = trainable.merge_and_unload() if trainable is not causal_lm(trainable) else trainable
        return merged.eval().requires_grad_(False)

    def _export(self, heads: DraftHeads, table: dict[str, Any] | None) -> Path:
        cfg = self.cfg
        training = {"target": cfg.heads.target, "loss_decay": cfg.heads.loss_decay, "data_source": cfg.data.source,
                    "self_distill": cfg.data.self_distill, "max_length": cfg.max_length,
                    "global_step": self.summary.get("global_step"), "seed": cfg.seed, "mode": cfg.heads.mode}
        base_name, model_cfg, base_model = cfg.model.name_or_path, cfg.model, self.base
        extra_base: dict[str, Any] = {}
        if self.joint:
            hc = cfg.heads
            training.update(finetune=hc.finetune, base_loss=cfg.base_loss, medusa_loss_weight=hc.medusa_loss_weight,
                            loss_ramp=hc.loss_ramp, heads_lr_multiplier=hc.heads_lr_multiplier,
                            init_from=str(self.init_heads_from) if self.init_heads_from else None)
            base_model = self.trained_base
            if hc.finetune != "frozen":
                # The heads fit the fine-tuned base only: it goes inside the export, recorded relative to it.
                save_base_model(self.trained_base.to("cpu"), self.tokenizer, self.paths.export)
                base_name = BASE_DIR
                model_cfg = dataclasses.replace(cfg.model, name_or_path=BASE_DIR, format="hf", gguf_file=None,
                                                tokenizer_path=None, revision=None)
                extra_base = {ORIGINAL_BASE_KEY: cfg.model.name_or_path}
        # The model/ config is recorded so tune-tree, eval and generate rebuild a GGUF or llama2.c base exactly.
        extra = {"training": training, **export_extra_config(model_cfg), **extra_base}
        vllm = cfg.export_vllm and heads.spec.head_type == "medusa"  # Hydra: warned about in check()
        out = save_export(heads, self.paths.export, base_name, extra_config=extra, vllm=vllm, base_model=base_model)
        if table is not None:
            record = {"split": "eval", "conversations": len(self.eval_set), "target": cfg.heads.target, **table}
            tmp = out / f".{ACCURACY_FILE}.tmp"
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, out / ACCURACY_FILE)
        log.info("exported heads to %s", out)
        return out

    # ---- Medusa-2 stage 1 ------------------------------------------------------------------------------------------

    def run_stage1(self) -> None:
        """Train the heads alone into ``${output_dir}/stage1`` (reused when ``resume=true`` finds its export), and
        start the joint stage from its export. The process group stays up for the joint stage."""
        self.hold()  # this run's own checks and lock first: a bad joint config fails before stage 1 trains
        folder = self.paths.root / STAGE1_DIR
        if self.cfg.resume and stage1_done(folder):
            log.info("stage 1: reusing the heads in %s", folder / "export")
        else:
            stage1 = TrainRecipe(stage1_config(self.resolved, folder, self.paths.self_distill))
            try:
                stage1.setup()
                stage1.train()
                stage1.save()
                stage1.finish_tracker()
            finally:
                stage1.release()
            self.summary["stage1"] = stage1.summary
            del stage1
        self.init_heads_from = folder / "export"

    # ---- cleanup -------------------------------------------------------------------------------------------------

    def finish_tracker(self, failed: bool = False) -> None:
        """Close the tracker run (wandb), if any."""
        if "wandb" in self.cfg.logger.report_to:
            import wandb

            if wandb.run is not None:
                wandb.finish(exit_code=1 if failed else 0)

    def cleanup(self, failed: bool = False) -> None:
        """Close the tracker run and the process group (without waiting for other ranks when this one ``failed``),
        and release ``output_dir``'s lock."""
        try:
            self.finish_tracker(failed)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                if not failed:
                    torch.distributed.barrier()
                torch.distributed.destroy_process_group()
        finally:
            self.release()

    def run(self) -> dict[str, Any]:
        """(Medusa-2 stage 1,) setup, train, save, cleanup; returns a summary (global_step, train_loss, accuracy,
        export_dir; ``stage1``: stage 1's summary)."""
        try:
            if self.joint and self.cfg.heads.stage1_epochs > 0:
                self.run_stage1()
            self.setup()
            self.train()
            self.save()
        except BaseException:
            self.cleanup(failed=True)
            raise
        self.cleanup()
        return self.summary
