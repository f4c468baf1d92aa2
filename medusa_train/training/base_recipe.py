"""The steps both training flows share (:class:`BaseRecipe`), used by
:class:`~medusa_train.training.frozen_base_recipe.FrozenBaseRecipe` and
:class:`~medusa_train.training.joint_recipe.JointRecipe`; a recipe runs ``setup`` -> ``train`` -> ``save`` ->
``cleanup`` (torchtune's recipe interface).

Everything that can be checked without a model is checked first, on every rank, reading only: config values, the
launcher's world size against the trainer strategy, DeepSpeed batch sizes, the data files, a ``base_placement``
the run cannot honour (:mod:`~medusa_train.training.base_placement`), ``output_dir`` itself
(not empty, not a file, not someone else's folder) and whether it holds another run, or a run that ``resume=true``
cannot continue with this config (:mod:`~medusa_train.training.run_dir`). Then the main process takes the folder's
lock (:mod:`~medusa_train.runs.run_lock`), the process group starts (through ``TrainingArguments``), the base
model loads (converted once, main process first; replicated on every rank, or partitioned by ZeRO-3 as
``base_placement`` resolves) and the data is prepared (self-distillation sharded over ranks: by vLLM or a server
before the base loads, so that the engines have the GPUs to themselves, its checks run on the base built on the
``meta`` device; by HF generate after it) and refused if too little is left. Only once the flow built its model is the folder changed: an overwritten run set
aside, unusable checkpoints dropped, ``train_config.yaml`` written. The run set aside is deleted once this run has
sealed its first checkpoint or written its export, and restored if this run ends before that (a run killed before
that leaves it for the next run to restore, right after taking the lock); so no failure of the new run costs the old
one. At the end every rank joins in gathering the trained fp32 weights (sharded under ZeRO-3) and checks them finite;
the main process measures per-head accuracy on the held-out split, prints the table and writes ``export/`` with
``train_head_accuracy.json``. The lock is released on the way out, whether the run succeeded or failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel, TrainerCallback, TrainingArguments, set_seed

from medusa_train.config.schema import FROZEN_BASE, JOINT, ModelConfig, TrainConfig, as_dataclass, train_schema
from medusa_train.export import save_base_model, save_export
from medusa_train.export.files import write_json
from medusa_train.models.catalog import drafter_type, heads_from_spec, is_drafter, spec_for_config, type_of
from medusa_train.loading.base import (
    base_weight_bytes,
    engine_model_path,
    load_base_model,
    load_tokenizer_and_config,
)
from medusa_train.loading.export import export_extra_config
from medusa_train.models.heads_base import build_token_map
from medusa_train.config.precision import choose_dtype, choose_precision
from medusa_train.models.speculative import DraftHeads, base_sizes, check_supported, new_heads_for
from medusa_train.training import checkpoints
from medusa_train.training.arguments import (
    DistEnv,
    check_deepspeed_batch,
    check_strategy,
    load_deepspeed_config,
    training_arguments,
    training_device,
    zero3_hidden_from_transformers,
)
from medusa_train.training.base_placement import (
    ZERO3,
    base_fits_device,
    check_base_placement,
    gathered,
    hf_deepspeed_config,
    is_zero3_config,
    partition_numel,
    replicate_output_and_input_embeddings,
    resolve_base_placement,
    start_deepspeed_comm,
    start_zero3_engine,
    zero3_inference_config,
)
from medusa_train.runs.disk_space import require_free
from medusa_train.training.callbacks import (
    DiscardOverwritten,
    Preempted,
    StopOnSignal,
    exit_callback_from_env,
    signal_callback_from_env,
)
from medusa_train.runs.drills import check_drills
from medusa_train.training.data_prep import PreparedData, check_data_source, check_enough_data, prepare_data
from medusa_train.training.head_accuracy import head_accuracy
from medusa_train.training.metrics import format_table
from medusa_train.training.process_group import from_main
from medusa_train.training.run_dir import (
    OutputDirError,
    RunPaths,
    check_location,
    check_output_dir,
    discard_overwritten,
    prepare_output_dir,
    settle_overwritten,
)
from medusa_train.runs.run_lock import RunLock, check_token
from medusa_train.training.step import FrozenBase, LossSpec
from medusa_train.training.trainer import DrafterTrainer, TrainingStopped, nonfinite_names

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
        node = OmegaConf.merge(OmegaConf.structured(train_schema()), given)
    resolved = OmegaConf.to_container(node, resolve=True)
    resolved.pop("hydra", None)
    return as_dataclass(TrainConfig, resolved), resolved


def gather_trainable_state(trainer: DrafterTrainer, keep: bool = True) -> dict[str, torch.Tensor]:
    """Full fp32 trained weights (parameters that require grad: the heads, and Medusa-2's adapters or base) and the
    heads' persistent buffers (their state_dict's), on the CPU; names as in ``trainer.model``.

    Under ZeRO-3 the parameters are sharded and under ZeRO-1/2 with bf16/fp16 the module holds low-precision copies;
    ``safe_get_full_fp32_param`` assembles the optimizer's fp32 master weights in both cases. It is a collective:
    under DeepSpeed every rank calls this. Frozen base weights are not gathered: they are the base model's, reloaded
    from its files where needed.

    Args:
        trainer: the trained Trainer.
        keep: False on the ranks that do not export: they take part in DeepSpeed's gathers and drop each weight at
            once, and return ``{}``. So a node holds one host copy of the fp32 weights (its main process's), not one
            per rank (70B Medusa-1 heads with full lm_head copies: about 17 GiB, against 133 GiB for 8 ranks).
    """
    model = trainer.model
    state = {}
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in model.named_parameters():
            if param.requires_grad:
                full = safe_get_full_fp32_param(param)  # a collective: every rank takes part, keep or not
                if keep:
                    state[name] = (full if full is not None else param.data).detach().float().cpu().clone()
    elif keep:
        state = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    if not keep:
        return {}
    for prefix, module in model.named_modules():
        if is_drafter(module):
            saved = module.state_dict(keep_vars=True)  # persistent buffers only (not EAGLE-3's RoPE tables)
            for name, buf in module.named_buffers():
                if name in saved:
                    state[f"{prefix}.{name}" if prefix else name] = buf.detach().cpu().clone()
    return state


class BaseRecipe:
    """One training run: what Medusa-1 and Medusa-2 do alike. A flow's recipe writes its ``setup`` (model and
    Trainer) and ``save_export`` (what is exported) from these steps.

    Args:
        cfg: the composed config (``TrainConfig``, Hydra ``DictConfig`` or a plain dict of the same shape).
        callbacks: extra ``TrainerCallback`` objects (tests, custom logging).

    Raises:
        ValueError: invalid settings, found before anything is loaded.
    """

    def __init__(self, cfg: TrainConfig | DictConfig | dict[str, Any], callbacks: Sequence[TrainerCallback] = ()):
        self.cfg, self.resolved = resolve_config(cfg)
        # trainer.precision=auto resolved once for the training device; self.resolved keeps what was asked for
        self.precision = choose_precision(self.cfg.trainer.precision, training_device(self.cfg.trainer))
        self.cfg.trainer.precision = self.precision.precision
        log.info(self.precision.describe())
        self.extra_callbacks = list(callbacks)
        self.env = DistEnv.from_environ()
        self.paths = RunPaths(Path(self.cfg.output_dir).resolve())
        self.trainer: DrafterTrainer | None = None
        self.summary: dict[str, Any] = {}
        self.lock: RunLock | None = None

    # ---- checks and the folder's lock -----------------------------------------------------------------------------

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
        check_base_placement(cfg, is_zero3_config(ds_config))
        check_output_dir(self.paths, self.resolved, cfg.resume, cfg.overwrite, self.env.world_size)
        return ds_config

    def hold(self) -> dict[str, Any] | None:
        """Main process: take ``output_dir``'s lock (once the folder passes :func:`check_location`), settle what a
        killed overwrite left (:func:`settle_overwritten`: the old run restored, or the committed one's deletion
        finished), then :meth:`check` under it, so that the folder cannot change between the checks and the run;
        other ranks: :meth:`check`. Returns the DeepSpeed config. A failed check releases the lock, leaving the folder
        as it was (one created for the lock is removed again).

        Raises:
            LockHeldError: another run holds the folder (named), see :class:`RunLock`.
        """
        if self.env.is_main and self.lock is None:
            check_location(self.cfg.output_dir)
            self.lock = RunLock.acquire(self.paths.root)
        try:
            if self.env.is_main:
                settle_overwritten(self.paths)
            return self.check()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Release ``output_dir``'s lock, if this process holds it (idempotent; see :meth:`RunLock.release`), first
        restoring a run that ``overwrite=true`` set aside and this run did not replace (it ended before its first
        checkpoint or export, see :func:`settle_overwritten`). A failed restore is logged, not raised (the error that
        ended the run stays the one reported); the next run in the folder restores it."""
        if self.lock is None:
            return
        try:
            settle_overwritten(self.paths)
        except (OSError, OutputDirError) as e:
            log.error("could not restore the run that overwrite=true set aside in %s (%s); the next run in this "
                      "folder restores it", self.paths.aside, e)
        finally:
            self.lock.release()
            self.lock = None

    def _check_lock_shared(self) -> None:
        """Under a launcher: every rank sees the lock its main process holds (one run, one shared folder)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        token = from_main(self.lock.holder.token if self.lock is not None else None)
        if not self.env.is_main:
            check_token(self.paths.root, token)

    # ---- setup steps -----------------------------------------------------------------------------------------------

    def start(self) -> TrainingArguments:
        """Checks and the folder's lock (:meth:`hold`), then the process group (through ``TrainingArguments``), the
        lock seen by every rank and the seed; returns the Trainer's arguments."""
        cfg = self.cfg
        check_drills()  # a bad drill variable fails now, not when its point is reached
        ds_config = self.hold()
        args = training_arguments(cfg.trainer, cfg.logger, checkpoints_dir=self.paths.checkpoints, seed=cfg.seed,
                                  deepspeed_config=ds_config, world_size=self.env.world_size)
        self.device = args.device  # starts the process group under a launcher
        from accelerate import PartialState

        self.barrier = PartialState().wait_for_everyone
        self._check_lock_shared()
        set_seed(cfg.seed)
        return args

    def check_base(self, base: PreTrainedModel) -> None:
        """Checks of the loaded base that must pass before the data is prepared (a flow adds its own): a supported
        architecture, and heads of ``heads.*``'s shape buildable for it (e.g. EAGLE-3's ``heads.feature_layers``
        within its layers, the fields named), before the data is prepared and the folder changed."""
        check_supported(base)
        spec_for_config(self.cfg.heads, base.config, *base_sizes(base))

    def load_base_and_data(self, args: TrainingArguments) -> PreparedData:
        """The base model and tokenizer (``self.base``, ``self.tokenizer``; converted once by the main process first),
        placed as :meth:`place_base` decides, checked (:meth:`check_base`), then the data (self-distillation sharded
        over ranks), refused if too little is left."""
        cfg = self.cfg
        with self.base_loading(args):
            first = cfg.data.self_distill and cfg.data.distill_engine != "hf"
            if first:  # vLLM or a server writes the replies before the base loads: the GPUs are the engines' alone
                data = self.prepare(args, *self.config_only(args))
            base, tokenizer = self.load_base(args)
            if self.placement == ZERO3:
                self.partitioned_base(base)
            self.check_base(base)
            self.base = base
            self.tokenizer = tokenizer
            if not first:
                data = self.prepare(args, base, tokenizer)
        check_enough_data(data, cfg.heads.num_heads, cfg.trainer, self.env.world_size)
        self.data = data
        return data

    def config_only(self, args: TrainingArguments) -> tuple[Any, Any]:
        """A stand-in for the base before it loads (its ``config`` and load ``dtype``), and its tokenizer (a GGUF or
        llama2.c checkpoint converted once, by the main process first); :meth:`check_base` passed on the base built
        on the ``meta`` device."""
        with args.main_process_first(desc="read the base model's config"):
            tokenizer, config = load_tokenizer_and_config(self.cfg.model)
        with torch.device("meta"):  # shapes only, no weights: the base's checks pass before anything is generated
            self.check_base(AutoModelForCausalLM.from_config(config, trust_remote_code=self.cfg.model.trust_remote_code))
        dtype = choose_dtype(self.cfg.model.dtype, self.device).dtype
        return types.SimpleNamespace(config=config, dtype=dtype), tokenizer

    def prepare(self, args: TrainingArguments, model: Any, tokenizer: Any) -> PreparedData:
        """The data (:func:`~medusa_train.training.data_prep.prepare_data`) with ``model``: the base, or before it
        loads a stand-in with its config and dtype (vLLM and server self-distillation need no more)."""
        cfg = self.cfg
        return prepare_data(
            cfg.data, tokenizer=tokenizer, model=model, max_length=cfg.max_length, seed=cfg.seed,
            self_distill_dir=Path(cfg.data.self_distill_dir or self.paths.self_distill),
            rank=self.env.rank, world_size=self.env.world_size, barrier=self.barrier, model_config=cfg.model,
            local_rank=self.env.local_rank,
        )

    def load_base(self, args: TrainingArguments) -> tuple[PreTrainedModel, Any]:
        """The base model and its tokenizer, GGUF and llama2.c checkpoints converted once (into the cache) by the
        main process first. A base partitioned by ZeRO-3 loads on every rank at once (its partitioning is
        collective), after that conversion."""
        model_cfg = self.model_config_on_device()
        if self.placement != ZERO3:
            with args.main_process_first(desc="load the base model"):
                return load_base_model(model_cfg)
        with args.main_process_first(desc="convert the base model"):
            path = engine_model_path(model_cfg)  # the converted HF folder, or name_or_path for an HF model
        return load_base_model(dataclasses.replace(model_cfg, name_or_path=path, format="hf", gguf_file=None)
                               if path != model_cfg.name_or_path else model_cfg)

    def base_loading(self, args: TrainingArguments) -> Any:
        """The context the base loads in, after :meth:`place_base` sets ``self.placement``: ``replicated``: the
        Trainer's DeepSpeed config hidden from transformers (the base loads whole); ``zero3`` with a frozen base:
        :func:`~medusa_train.training.base_placement.zero3_inference_config` shown instead (it loads partitioned);
        ``zero3`` with Medusa-2: the Trainer's own ZeRO-3 config (its engine will train the partitioned base)."""
        self.placement = self.place_base(args)
        self.base_engine: Any = None
        trainer_ds = getattr(args, "hf_deepspeed_config", None)
        if self.placement != ZERO3:
            return zero3_hidden_from_transformers(args)
        if self.cfg.heads.mode == JOINT:
            start_deepspeed_comm()  # the Trainer's engine starts later; the partitioned load needs the world size
            return contextlib.nullcontext()
        self.base_ds_config = zero3_inference_config(choose_dtype(self.cfg.model.dtype, self.device).dtype)
        return hf_deepspeed_config(self.base_ds_config, trainer_ds)

    def place_base(self, args: TrainingArguments) -> str:
        """``base_placement`` resolved for this run (:func:`~medusa_train.training.base_placement.
        resolve_base_placement`, logged); the fit test reads the base's size from its config (no weights loaded)."""
        trainer_zero3 = is_zero3_config(args.deepspeed if isinstance(args.deepspeed, dict) else None)
        fits = True
        if self.cfg.base_placement == "auto" and self.device.type == "cuda" and self.env.world_size > 1:
            fits = base_fits_device(base_weight_bytes(self.cfg.model, self.device), self.device)
        return resolve_base_placement(self.cfg, world_size=self.env.world_size, trainer_zero3=trainer_zero3,
                                      fits=fits)

    def partitioned_base(self, base: PreTrainedModel) -> None:
        """A base loaded partitioned by ZeRO-3: log the share this rank holds; for a frozen base start its ZeRO-3
        engine (``self.base_engine``) and replicate its lm_head and input embeddings, which the heads read."""
        held, total = partition_numel(base)
        log.info("base placement zero3: rank %d holds %d of the base's %d parameters", self.env.rank, held, total)
        self.summary["base_partition"] = {"rank": self.env.rank, "held": held, "total": total}
        if self.cfg.heads.mode == FROZEN_BASE:
            self.base_engine = start_zero3_engine(base, self.base_ds_config)
            replicate_output_and_input_embeddings(base)

    def model_config_on_device(self) -> ModelConfig:
        """``model/`` with the device the Trainer uses (``cuda:LOCAL_RANK``, or the CPU)."""
        return dataclasses.replace(self.cfg.model, device="cpu" if self.device.type == "cpu" else str(self.device))

    def new_heads(self, data: PreparedData) -> DraftHeads:
        """Fresh heads for the base (``heads/``), with the token map counted on the training labels when
        ``heads.head_vocab_size`` is set."""
        hc = self.cfg.heads
        token_map = None
        if hc.head_vocab_size is not None:
            vocab_size = base_sizes(self.base)[1]
            counts = torch.zeros(vocab_size, dtype=torch.long)
            for labels in data.train["labels"]:
                ids = torch.as_tensor(labels, dtype=torch.long)
                counts += torch.bincount(ids[ids >= 0], minlength=vocab_size)
            token_map = build_token_map(counts, hc.head_vocab_size)
        with gathered(self.base.get_output_embeddings().weight):  # Medusa-2 under ZeRO-3: the heads copy it whole
            return new_heads_for(self.base, hc.num_heads, hc.num_layers, hc.share_lm_head, token_map,
                                 head_type=hc.head_type, **drafter_type(hc.head_type).spec_options(hc))

    def loss_spec_for(self, heads: DraftHeads) -> LossSpec:
        """The heads' loss settings (``heads/``), with their token map on the training device."""
        hc = self.cfg.heads
        vocab_size = base_sizes(self.base)[1]
        return LossSpec(target=hc.target, decay=hc.loss_decay, share_lm_head=hc.share_lm_head, vocab_size=vocab_size,
                        num_heads=heads.spec.num_heads,
                        token_map=None if heads.token_map is None else heads.token_map.to(self.device),
                        head_type=heads.spec.head_type, features=type_of(heads).feature_names(heads.spec),
                        loss_chunk_size=self.cfg.trainer.loss_chunk_size)

    def prepare_folder(self, trained: nn.Module) -> None:
        """The run is known to start: only now is the folder changed (main process), after :meth:`check_disk` for
        the ``trained`` module's checkpoints and export; then every rank waits."""
        if self.env.is_main:
            self.check_disk(trained)
            prepare_output_dir(self.paths, self.resolved, self.cfg.overwrite, resume=self.cfg.resume)
        self.barrier()

    def check_disk(self, trained: nn.Module) -> None:
        """Room in ``output_dir`` for two checkpoints (the one being written beside the last sealed one: the trainable
        weights in their dtype and Adam's fp32 m and v, 8 B a parameter) and the export (fp32, up to three layouts:
        ours, FasterDecoding's ``.pt``, ``vllm/``). A lower bound: a base saved with the export (Medusa-2) and
        checkpoints beyond ``trainer.save_total_limit`` are not counted.

        Raises:
            DiskSpaceError: the bytes needed and free named, before the folder changes or training starts.
        """
        trainable = [p for p in trained.parameters() if p.requires_grad]
        count = sum(p.numel() for p in trainable)
        checkpoint = sum(p.numel() * p.element_size() for p in trainable) + 8 * count
        export = 3 * 4 * count
        require_free(self.paths.root, 2 * checkpoint + export,
                     f"two checkpoints ({checkpoint:,} bytes each: {count:,} trainable parameters and their Adam "
                     f"state) and the export ({export:,} bytes)",
                     "free space there or choose another output_dir", prefix="output_dir: ")

    def trainer_kwargs(self, args: TrainingArguments, train_set: Any, eval_set: Any) -> dict[str, Any]:
        """The :class:`DrafterTrainer` arguments both flows give: datasets, collator, callbacks
        (:class:`~medusa_train.training.callbacks.DiscardOverwritten` with ``overwrite=true``,
        :class:`~medusa_train.training.callbacks.StopOnSignal`, the caller's, then the drills' ``ExitAfterStep`` and
        ``SignalAtStep`` when their variables ask for them), loss settings, rotation."""
        # the commit first: no other on_save (one that stops the process, or waits) comes between it and the seal
        commit = [DiscardOverwritten(self.paths)] if self.cfg.overwrite else []
        self.stop_on_signal = StopOnSignal()
        callbacks = [*commit, self.stop_on_signal, *self.extra_callbacks]
        callbacks += [cb for cb in (exit_callback_from_env(), signal_callback_from_env()) if cb is not None]
        return dict(args=args, train_dataset=train_set, eval_dataset=eval_set if len(eval_set) else None,
                    data_collator=self.collator, callbacks=callbacks, loss_spec=self.loss_spec,
                    keep_checkpoints=self.cfg.trainer.save_total_limit)

    # ---- train -----------------------------------------------------------------------------------------------------

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
        load_before = os.getloadavg()[0]  # the machine's conditions while training (other work on shared cores)
        result = self.trainer.train(resume_from_checkpoint=resume_from)
        self.summary["load_average"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
        if self.device.type == "cuda":  # the run's peak so far (the cache build included), against the plan's
            self.summary["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        stop = self.stop_on_signal
        if stop.stopped_at is not None:
            log.warning("stopped on a signal after step %d; the checkpoint is sealed", stop.stopped_at)
            raise Preempted(stop.stopped_at, stop.received)
        self.summary.update(global_step=result.global_step, train_loss=result.training_loss,
                            train_metrics=result.metrics, resumed_from=resume_from)

    # ---- save ------------------------------------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Gather the trained weights and check them finite (every rank), then the flow's :meth:`save_export` on the
        main process, and the run that ``overwrite=true`` set aside deleted, if no checkpoint did that already.
        Returns ``export/`` (None on other ranks, or with ``export=false``).

        Raises:
            TrainingStopped: a trained weight is not finite (nothing is exported; raised on every rank).
        """
        state = gather_trainable_state(self.trainer, keep=self.env.is_main)  # one host copy, the main process's
        bad = from_main(nonfinite_names(state.items()))  # the main process's verdict: every rank stops together
        if bad:
            raise TrainingStopped(f"the trained weights are not finite ({', '.join(bad[:4])}): nothing is exported; "
                                  "lower trainer.learning_rate and start again with overwrite=true")
        export_dir = self.save_export(state) if self.env.is_main else None
        if self.env.is_main:
            discard_overwritten(self.paths)  # the run is complete: the one it overwrote goes (if no checkpoint did)
        self.barrier()
        return export_dir

    def save_export(self, state: dict[str, torch.Tensor]) -> Path | None:
        """Main process: the flow's accuracy table and export from the gathered ``state``."""
        raise NotImplementedError

    def trained_heads(self, heads_state: dict[str, torch.Tensor]) -> DraftHeads:
        """Heads of the trained shape holding ``heads_state`` (strictly), on the training device."""
        heads = heads_from_spec(self.trainer.model.spec, token_map=heads_state.get("token_map"))
        heads.load_state_dict(heads_state, strict=True)
        return heads.to(self.trainer.args.device)

    def accuracy_table(self, heads: DraftHeads, frozen_base: FrozenBase) -> dict[str, Any] | None:
        """Per-head accuracy on the held-out split (printed, and kept in the summary); None without one."""
        table = None
        if len(self.eval_set):
            table = head_accuracy(heads, frozen_base, self.eval_set, self.collator, self.loss_spec,
                                  self.trainer.args.per_device_eval_batch_size, self.trainer.args.device)
            print(f"per-head accuracy on the eval split ({len(self.eval_set)} conversations, "
                  f"target {self.cfg.heads.target}):\n{format_table(table)}", flush=True)
        else:
            log.warning("data.eval_fraction=0: no held-out conversations, no accuracy table")
        self.summary["accuracy"] = table
        return table

    def training_record(self) -> dict[str, Any]:
        """The ``training`` entry of the export's config (a flow adds its settings); ``precision`` the mixed
        precision trained in (:meth:`~medusa_train.config.precision.PrecisionChoice.record`: asked for, used, why);
        ``memory`` holds the memory plan's peak per device and, on CUDA, ``torch.cuda.max_memory_allocated`` after
        training (bytes; None where not planned or not measured); ``data`` the data's counts
        (:meth:`PreparedData.record`: labelled tokens, skips); ``train_runtime_s`` the Trainer's seconds in this
        process (a resumed run: since ``resumed_from``) and ``load_average`` the machine's 1-minute load average
        before and after them."""
        cfg = self.cfg
        return {"target": cfg.heads.target, "loss_decay": cfg.heads.loss_decay, "data_source": cfg.data.source,
                "self_distill": cfg.data.self_distill, "max_length": cfg.max_length,
                "global_step": self.summary.get("global_step"), "seed": cfg.seed, "mode": cfg.heads.mode,
                "precision": self.precision.record(),
                "memory": {"planned_peak_device_bytes": self.summary.get("planned_peak_device_bytes"),
                           "measured_peak_device_bytes": self.summary.get("peak_device_memory_bytes")},
                "data": self.data.record() if getattr(self, "data", None) is not None else None,
                "num_train_epochs": cfg.trainer.num_train_epochs, "max_steps": cfg.trainer.max_steps,
                "train_runtime_s": (self.summary.get("train_metrics") or {}).get("train_runtime"),
                "resumed_from": self.summary.get("resumed_from"), "load_average": self.summary.get("load_average")}

    def write_export(self, heads: DraftHeads, table: dict[str, Any] | None, *, base_name: str,
                     model_cfg: ModelConfig, base_model: Any, extra: dict[str, Any] | None = None,
                     base_dir: tuple[Any, str] | None = None) -> Path:
        """Write ``export/`` (heads on the CPU, config naming ``base_name``, the ``model/`` config ``model_cfg`` so
        that tune-tree, eval and generate rebuild a GGUF or llama2.c base exactly, and ``extra`` entries) with
        ``train_head_accuracy.json`` and, given ``base_dir`` = ``(model, name)``, the model and the tokenizer saved in
        ``export/<name>``: all replaced as one set (:func:`~medusa_train.export.save_export`); returns the
        folder."""
        cfg = self.cfg
        config = {"training": self.training_record(), **export_extra_config(model_cfg), **(extra or {})}
        vllm = cfg.export_vllm and type_of(heads).engine_problem("vllm") is None  # else warned about in check()

        def write_also(folder: Path) -> None:
            if table is not None:
                record = {"split": "eval", "conversations": len(self.eval_set), "target": cfg.heads.target, **table}
                write_json(folder / ACCURACY_FILE, record)
            if base_dir is not None:
                save_base_model(base_dir[0], self.tokenizer, folder, name=base_dir[1])

        owns = (ACCURACY_FILE,) if base_dir is None else (ACCURACY_FILE, base_dir[1])
        out = save_export(heads, self.paths.export, base_name, extra_config=config, vllm=vllm, base_model=base_model,
                          write_also=write_also, also_owns=owns)
        log.info("exported heads to %s", out)
        self.summary["export_dir"] = str(out)
        return out

    # ---- cleanup ---------------------------------------------------------------------------------------------------

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

    def steps(self) -> None:
        """What :meth:`run` does between its start and cleanup: setup, train, save."""
        self.setup()
        self.train()
        self.save()

    def setup(self) -> None:
        raise NotImplementedError

    def run(self) -> dict[str, Any]:
        """:meth:`steps`, then cleanup (also when they fail); returns a summary (global_step, train_loss, accuracy,
        export_dir, and what the flow adds)."""
        try:
            self.steps()
        except BaseException:
            self.cleanup(failed=True)
            raise
        self.cleanup()
        return self.summary
