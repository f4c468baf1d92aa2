"""The joint recipe (``heads.mode=joint``, Medusa-2's): the base model (LoRA, full or frozen) and the heads trained
together (Medusa paper, arXiv:2401.10774, Sec. 2.2.2).

stage 1: when ``heads.stage1_epochs > 0`` a frozen-base run trains the heads alone into ``${output_dir}/stage1``
(:mod:`medusa_train.training.stages`, :class:`~medusa_train.training.frozen_base_recipe.FrozenBaseRecipe`) and the joint
stage starts from its export; otherwise from ``heads.init_from``. setup: checks (heads to start from made for this
base; no ``share_lm_head`` under ZeRO-3) and the folder's lock, process group, base model (LoRA targets checked
before the data is prepared) and data (:class:`BaseRecipe`); the starting heads, checked against the base and
``heads/``; the base made trainable (:func:`~medusa_train.training.joint.prepare_base`) and joined with the heads
(:class:`~medusa_train.training.joint.JointModel`); the folder prepared and the HF Trainer built
(:class:`~medusa_train.training.joint_trainer.JointTrainer`). train: :meth:`BaseRecipe.train`. save: the trained base
rebuilt from a fresh load of ``model/`` with the gathered weights (LoRA merged), the heads measured against it, and
the export written with the fine-tuned base inside it (``export/base``).

ZeRO-3 (``trainer=deepspeed_zero3``; ``base_placement`` auto or ``zero3``): the base loads partitioned, under the
Trainer's own DeepSpeed config (``deepspeed.zero.Init`` inside ``from_pretrained``), so no rank ever holds it whole;
peft's LoRA adapters are added to the partitioned modules and the Trainer's engine partitions them, the heads and the
optimizer state over the ranks. Tested on 2 CPU ranks (gloo) with a tiny Llama. The plan for Llama-3.1-70B on 8 GPUs
(planned, not run here): the bf16 base is 141 GB, 17.6 GB a rank; LoRA r=16 on the attention projections adds about
0.07 B trainable parameters (16 bytes each for weights, gradients and Adam states: 0.13 GB a rank); the heads with the full
vocabulary are K x V x H = 4 x 128,256 x 8,192 = 4.2 B parameters (fp32 weights, gradients and Adam states, 16
bytes each: 67 GB, 8.4 GB a rank), so ``heads.head_vocab_size`` is the lever (``heads.share_lm_head`` is refused under
ZeRO-3); the KL reference is the same partitioned base with its adapters disabled, not a copy; activations of 80
layers need gradient checkpointing (``trainer.extra.gradient_checkpointing``). Two steps do not scale yet and are
the plan: ``trained_base_from`` reloads the base whole on the main process's device to merge the adapters (141 GB:
it must load on the CPU there, or the export keep the adapters for an offline merge), and the accuracy table runs the
merged base on the main process alone.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from medusa_train.data import Collator
from medusa_train.export import BASE_DIR, load_heads
from medusa_train.export.configs import export_head_type
from medusa_train.models.catalog import expect_head_type
from medusa_train.loading.base import load_base_model
from medusa_train.loading.export import ORIGINAL_BASE_KEY, check_export_base
from medusa_train.models.speculative import DraftHeads, check_heads_match_base
from medusa_train.training.arguments import zero3_hidden_from_transformers
from medusa_train.training.base_recipe import BaseRecipe
from medusa_train.training.joint import (
    JointModel,
    causal_lm,
    load_trainable_state,
    lora_target_modules,
    prepare_base,
)
from medusa_train.training.joint_trainer import JointSpec, JointTrainer
from medusa_train.training.frozen_base_recipe import FrozenBaseRecipe
from medusa_train.training.stages import STAGE1_DIR, stage1_config, stage1_done
from medusa_train.training.step import FrozenBase

log = logging.getLogger(__name__)


class JointRecipe(BaseRecipe):
    """One Medusa-2 run (see the module docstring); arguments as :class:`BaseRecipe`. The summary holds stage 1's
    under ``stage1`` when stage 1 trained here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_heads_from: Path | None = Path(self.cfg.heads.init_from) if self.cfg.heads.init_from else None

    def check(self) -> dict[str, Any] | None:
        """:meth:`BaseRecipe.check`, then what needs no model: heads to start from (``heads.init_from``) made for this
        base, and no ``heads.share_lm_head`` under ZeRO-3.

        Raises:
            ValueError: either of these (the field and the fix named).
        """
        ds_config = super().check()
        hc = self.cfg.heads
        if hc.init_from:
            config = check_export_base(hc.init_from, self.cfg.model, "heads.init_from")
            expect_head_type(export_head_type(config), hc.head_type, f"heads.init_from={hc.init_from}")
        zero3 = ds_config is not None and ds_config["zero_optimization"]["stage"] == 3
        if zero3 and hc.share_lm_head:
            raise ValueError("heads.share_lm_head=true with heads.mode=joint under ZeRO-3: the heads would read the "
                             "sharded lm_head weight outside its module; use heads.share_lm_head=false or ZeRO-2")
        return ds_config

    def steps(self) -> None:
        """Stage 1 (``heads.stage1_epochs > 0``), then setup, train, save."""
        if self.cfg.heads.stage1_epochs > 0:
            self.run_stage1()
        super().steps()

    # ---- stage 1 ---------------------------------------------------------------------------------------------------

    def run_stage1(self) -> None:
        """Train the heads alone into ``${output_dir}/stage1`` (reused when ``resume=true`` finds its export), and
        start the joint stage from its export. The process group stays up for the joint stage."""
        self.hold()  # this run's own checks and lock first: a bad joint config fails before stage 1 trains
        folder = self.paths.root / STAGE1_DIR
        if self.cfg.resume and stage1_done(folder):
            log.info("stage 1: reusing the heads in %s", folder / "export")
        else:
            stage1 = FrozenBaseRecipe(stage1_config(self.resolved, folder, self.paths.self_distill))
            try:
                stage1.steps()
                stage1.finish_tracker()
            finally:
                stage1.release()
            self.summary["stage1"] = stage1.summary
            del stage1
        self.init_heads_from = folder / "export"

    # ---- setup -----------------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Checks and lock, process group, base model, data, starting heads, the joint model, then the folder is
        prepared and the Trainer built."""
        args = self.start()
        data = self.load_base_and_data(args)
        heads = self.initial_heads() if self.init_heads_from else self.new_heads(data)
        self.loss_spec = self.loss_spec_for(heads)
        self.collator: Any = Collator.from_tokenizer(self.tokenizer)
        self.eval_set = data.eval
        self.prepare_folder(heads)
        model = JointModel(prepare_base(self.base, self.cfg.heads), heads)
        self.trainer = JointTrainer(model=model, joint_spec=JointSpec.of(self.cfg.heads, self.cfg.base_loss),
                                    **self.trainer_kwargs(args, data.train, data.eval))

    def check_base(self, base: PreTrainedModel) -> None:
        """:meth:`BaseRecipe.check_base`, and with LoRA its target modules (before the data is prepared)."""
        super().check_base(base)
        if self.cfg.heads.finetune == "lora":
            lora_target_modules(base, self.cfg.heads.lora.target_modules)

    def initial_heads(self) -> DraftHeads:
        """Heads to start the joint stage from (``heads.init_from`` or stage 1's export), checked against the base
        and ``heads/``, in fp32 on the base's device.

        Raises:
            ValueError: heads made for another base (hidden size, vocabulary), or a shape other than ``heads/`` asks
                for.
        """
        hc = self.cfg.heads
        source = self.init_heads_from
        heads, _ = load_heads(source, base_model=self.base, head_type=hc.head_type)
        check_heads_match_base(heads.spec, self.base)
        asked = {"num_heads": hc.num_heads, "num_layers": hc.num_layers,
                 "share_lm_head": hc.share_lm_head, "head_vocab_size": hc.head_vocab_size}
        found = {"num_heads": heads.spec.num_heads, "num_layers": heads.spec.num_layers,
                 "share_lm_head": heads.spec.share_lm_head, "head_vocab_size": heads.spec.head_vocab_size}
        differ = [f"heads.{k}={asked[k]} (the export has {found[k]})" for k in asked if asked[k] != found[k]]
        if differ:
            raise ValueError(f"heads in {source} do not have the shape heads/ asks for: {', '.join(differ)}; "
                             "set these to the export's values")
        log.info("joint stage starts from the heads in %s", source)
        return heads.to(device=self.base.get_output_embeddings().weight.device, dtype=torch.float32)

    # ---- save ------------------------------------------------------------------------------------------------------

    def save_export(self, state: dict[str, torch.Tensor]) -> Path | None:
        """Main process: the trained base (LoRA merged), the heads' accuracy table against it, then ``export/`` with
        the fine-tuned base inside (``export=true``)."""
        heads_state = {k.removeprefix("heads."): v for k, v in state.items() if k.startswith("heads.")}
        self.trained_base = self.trained_base_from(
            {k.removeprefix("base."): v for k, v in state.items() if k.startswith("base.")})
        heads = self.trained_heads(heads_state)
        table = self.accuracy_table(heads, FrozenBase.of(self.trained_base))
        if not self.cfg.export:
            return None
        cfg = self.cfg
        if cfg.heads.finetune == "frozen":
            return self.write_export(heads.cpu(), table, base_name=cfg.model.name_or_path, model_cfg=cfg.model,
                                     base_model=self.trained_base)
        # The heads fit the fine-tuned base only: it goes inside the export, recorded relative to it, written with
        # the heads as one set (a failed write leaves the old heads with the old base).
        model_cfg = dataclasses.replace(cfg.model, name_or_path=BASE_DIR, format="hf", gguf_file=None,
                                        tokenizer_path=None, revision=None)
        return self.write_export(heads.cpu(), table, base_name=BASE_DIR, model_cfg=model_cfg,
                                 base_model=self.trained_base, extra={ORIGINAL_BASE_KEY: cfg.model.name_or_path},
                                 base_dir=(self.trained_base.to("cpu"), BASE_DIR))

    def trained_base_from(self, base_state: dict[str, torch.Tensor]) -> Any:
        """Main process: the base model as trained, as a plain ``*ForCausalLM`` (LoRA merged), on the training device.

        Built from a fresh load of ``model/`` (outside any ZeRO-3 partitioning) with the gathered trained weights
        copied in, so one path serves every strategy; this holds a second copy of the base in memory for a moment.
        """
        with zero3_hidden_from_transformers(self.trainer.args):
            fresh, _ = load_base_model(self.model_config_on_device())
        if self.cfg.heads.finetune == "frozen":
            return fresh
        trainable = prepare_base(fresh, self.cfg.heads)
        load_trainable_state(trainable, base_state, "the trained base weights")
        merged = trainable.merge_and_unload() if trainable is not causal_lm(trainable) else trainable
        return merged.eval().requires_grad_(False)

    def training_record(self) -> dict[str, Any]:
        """:meth:`BaseRecipe.training_record` and the joint settings."""
        cfg, hc = self.cfg, self.cfg.heads
        return {**super().training_record(), "finetune": hc.finetune, "base_loss": cfg.base_loss,
                "medusa_loss_weight": hc.medusa_loss_weight, "loss_ramp": hc.loss_ramp,
                "heads_lr_multiplier": hc.heads_lr_multiplier,
                "init_from": str(self.init_heads_from) if self.init_heads_from else None}
