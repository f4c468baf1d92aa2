"""The HF Trainer for Medusa-2: the Trainer's model is :class:`~medusa_train.training.joint.JointModel`.

What changes from :class:`~medusa_train.training.trainer.DrafterTrainer` (whose metrics, normalisation over ranks and
accumulation steps, atomic checkpoints and rotation are kept):

- ``compute_loss``: ``L_base / N + lambda_0 * s(t) * sum_k decay^k L_k / N`` (Medusa paper, arXiv:2401.10774,
  Sec. 2.2.2), with N the optimizer step's labelled tokens, ``L_base`` the LM or KL loss
  (:mod:`medusa_train.training.joint_loss`) and the heads' targets taken from the *current* base logits (the heads
  must predict what the fine-tuned base, the one exported, will say). The heads run only at the positions some head
  is trained on, through the same loss as Medusa-1 (:class:`~medusa_train.training.step.HeadTargets`): inside the
  heads' forward, ``trainer.loss_chunk_size`` rows projected at a time (with 0, from the logits held at once). The
  base's own loss and argmax are projected in chunks of the same size
  (:class:`~medusa_train.training.joint.BaseLossRequest`), so no ``[B, T, V]`` logits are held, except with
  ``soft`` targets (they read the base's distribution at every position), ``loss_chunk_size=0`` or a fully
  fine-tuned lm_head under ZeRO-3.
- ``create_optimizer``: the stock optimizer (``trainer.optim``) over two learning rates: ``learning_rate`` for the
  base's trainable weights (LoRA adapters or all), ``learning_rate * heads_lr_multiplier`` for the heads; weight
  decay as the Trainer decides per parameter. The scheduler scales both groups alike.
- ``log``: ``base_loss`` (per labelled token, summed over ranks) and ``medusa_weight`` (lambda_0 * s(t)).
- ``save_model``: checkpoints hold the trainable weights only (:data:`TRAINABLE_FILE`, the stock
  ``model.safetensors``: adapters or the full base, and the heads); the frozen weights come back from the base model.
  The stock Trainer resumes from that file, loading it non-strictly, which
  :meth:`~medusa_train.training.joint.JointModel.load_state_dict` turns into "every trainable weight, nothing
  else". Under DeepSpeed the engine's own checkpoint (written by the Trainer beside it) is what resumes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.utils import SAFE_WEIGHTS_NAME

from medusa_train.config.schema import JointSettings
from medusa_train.training.joint import BaseLossRequest, trainable_state
from medusa_train.training.joint_loss import base_loss_sum, next_token_positions, ramp
from medusa_train.training.losses import head_targets
from medusa_train.training.step import BaseDistributions, HeadTargets, chunks, counted_positions
from medusa_train.training.trainer import DrafterTrainer

# The Trainer's own weights file, so that its resume finds it; here it holds the trainable weights only.
TRAINABLE_FILE = SAFE_WEIGHTS_NAME

__all__ = ["TRAINABLE_FILE", "JointSpec", "JointTrainer"]


@dataclass(frozen=True)
class JointSpec:
    """Medusa-2 loss and optimizer settings, as :class:`~medusa_train.config.schema.JointSettings` gives them (its
    defaults are the only ones), with the base loss resolved.

    Attributes:
        base_loss: ``lm`` or ``kl``.
        medusa_loss_weight: lambda_0.
        loss_ramp: ``constant``, ``linear`` or ``sine``.
        ramp_steps: R, or None for ``ramp_ratio`` of the run's optimizer steps.
        ramp_ratio: R as a share of all steps.
        heads_lr_multiplier: heads' learning rate / base's.
    """

    base_loss: str
    medusa_loss_weight: float
    loss_ramp: str
    ramp_steps: int | None
    ramp_ratio: float
    heads_lr_multiplier: float

    @classmethod
    def of(cls, settings: JointSettings, base_loss: str) -> JointSpec:
        """From ``heads/`` (``settings``) and the resolved base loss (``lm`` or ``kl``, see ``TrainConfig``)."""
        return cls(base_loss=base_loss, medusa_loss_weight=settings.medusa_loss_weight, loss_ramp=settings.loss_ramp,
                   ramp_steps=settings.ramp_steps, ramp_ratio=settings.ramp_ratio,
                   heads_lr_multiplier=settings.heads_lr_multiplier)


class JointTrainer(DrafterTrainer):
    """``DrafterTrainer`` for a :class:`~medusa_train.training.joint.JointModel` (Medusa-2).

    Args:
        joint_spec: base loss, lambda_0, ramp and learning-rate multiplier.
        **kwargs: :class:`DrafterTrainer` arguments (``model`` = the joint module, ``loss_spec`` for the heads,
            ``frozen_base`` is None).
    """

    def __init__(self, *, joint_spec: JointSpec, **kwargs: Any) -> None:
        kwargs.setdefault("frozen_base", None)
        super().__init__(**kwargs)
        self.joint_spec = joint_spec
        # rows: base-loss sum, counted positions (this rank, since the last log), per phase
        self.base_sums = {"train": torch.zeros(2, dtype=torch.float64), "eval": torch.zeros(2, dtype=torch.float64)}

    # ---- loss ----------------------------------------------------------------------------------------------------

    def medusa_weight(self) -> float:
        """lambda_0 * s(t) at the current optimizer step."""
        js = self.joint_spec
        total = max(int(self.state.max_steps or 0), 0)
        ramp_steps = js.ramp_steps if js.ramp_steps is not None else round(js.ramp_ratio * total)
        return js.medusa_loss_weight * ramp(js.loss_ramp, int(self.state.global_step), ramp_steps)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Medusa-2 loss of one micro-batch (see the module docstring)."""
        labels = inputs["labels"]
        spec = self.loss_spec
        b, t = counted_positions(labels, spec.num_heads)  # the heads run only where some head is trained
        # the base loss counts the positions predicting an assistant token (what base_loss_sum returns as its count)
        normalizer = (num_items_in_batch if num_items_in_batch is not None
                      else next_token_positions(labels).sum().float().clamp_min(1))

        def targets_of(base_argmax: torch.Tensor | None, base_logits: torch.Tensor | None) -> HeadTargets:
            """The heads' targets ``[K, M]`` and the base's distributions, from the current base's argmax ``[B, T]``
            (None: taken from the logits, where the targets need it) and logits ``[B, T, V]`` (detached: targets are
            constants; None when the base's loss ran in chunks)."""
            if base_argmax is None and base_logits is not None and spec.target != "labels":
                base_argmax = base_logits.argmax(-1)
            targets = head_targets(labels, spec.num_heads, target=spec.target,
                                   base_argmax=base_argmax if spec.target != "labels" else None)[:, b, t]
            return HeadTargets(targets, b, t, spec, normalizer,
                               BaseDistributions(logits=base_logits, token_map=spec.token_map))

        chunked = chunks(spec)
        # the base's loss in chunks too, except for soft targets: they read the base's logits at every position
        request = (BaseLossRequest(self.joint_spec.base_loss, labels, spec.loss_chunk_size,
                                   argmax=spec.target == "base_argmax")
                   if chunked and spec.target != "soft" else None)

        def head_loss_for(argmax: torch.Tensor | None, logits: torch.Tensor | None):
            return targets_of(argmax, logits).project_fn()

        out = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                    with_reference=self.joint_spec.base_loss == "kl", positions=(b, t),
                    head_loss_for=head_loss_for if chunked else None, base_loss=request)
        base_sum, base_count = (out.base_loss if out.base_loss is not None
                                else base_loss_sum(self.joint_spec.base_loss, out.logits, labels, out.reference_logits))
        if chunked:
            heads_out = out.head_loss
        else:
            heads_out = targets_of(None, out.logits.detach()).loss(out.head_logits)
        loss = self._record_and_scale(base_sum / normalizer + self.medusa_weight() * heads_out.loss, heads_out,
                                      model, inputs, num_items_in_batch)
        phase = self.phase(model)
        sums = torch.stack([base_sum.detach(), base_count]).to(torch.float64)
        if self.base_sums[phase].device != sums.device:
            self.base_sums[phase] = self.base_sums[phase].to(sums.device)
        self.base_sums[phase] += sums
        return (loss, {}) if return_outputs else loss

    def _base_summary(self, phase: str, prefix: str = "") -> dict[str, float]:
        sums = self._reduce_sum(self.base_sums[phase]).cpu()
        self.base_sums[phase] = torch.zeros_like(self.base_sums[phase])
        if float(sums[1]) == 0:
            return {}
        return {f"{prefix}base_loss": round(float(sums[0] / sums[1]), 6)}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Per-head metrics (DrafterTrainer), plus ``base_loss`` and ``medusa_weight`` on training logs."""
        if "loss" in logs:
            logs = {**logs, **self._base_summary("train"), "medusa_weight": round(self.medusa_weight(), 6)}
        super().log(logs, start_time)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        self.base_sums["eval"].zero_()
        output = super().evaluation_loop(*args, **kwargs)
        output.metrics.update(self._base_summary("eval", prefix=f"{kwargs.get('metric_key_prefix', 'eval')}_"))
        return output

    # ---- optimizer -----------------------------------------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer class and settings over four groups: base/heads x decay/no decay; the heads'
        learning rate is ``learning_rate * heads_lr_multiplier``. Empty groups (a frozen base) are left out."""
        opt_model = self.model if model is None else model
        if self.optimizer is not None:
            return self.optimizer
        decay = set(self.get_decay_parameter_names(opt_model))
        lr = self.args.learning_rate
        groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for name, p in opt_model.named_parameters():
            if p.requires_grad:
                groups.setdefault((name.startswith("heads."), name in decay), []).append(p)
        param_groups = [
            {"params": params, "weight_decay": self.args.weight_decay if is_decay else 0.0,
             "lr": lr * self.joint_spec.heads_lr_multiplier if is_heads else lr}
            for (is_heads, is_decay), params in sorted(groups.items())
        ]
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        return self.optimizer

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank: refuse non-finite trainable weights (as :class:`DrafterTrainer`), then write the trainable
        weights into ``output_dir/``:data:`TRAINABLE_FILE` on the main process. Under DeepSpeed they come from the
        engine's gathered 16-bit state (collective); ZeRO-3 without ``stage3_gather_16bit_weights_on_model_save`` gives
        none, and the engine checkpoint alone holds them (written here, as the stock Trainer does)."""
        self._check_finite_weights(self.model)
        output_dir = output_dir or self.args.output_dir
        gathered = None
        if self.is_deepspeed_enabled:
            try:
                gathered = self.accelerator.get_state_dict(self.model_wrapped)
            except ValueError:  # ZeRO-3 without the 16-bit gather on save
                self.model_wrapped.save_checkpoint(output_dir)
                return
        if not self.args.should_save:
            return
        if gathered is None:
            tensors = trainable_state(self.model)
        else:
            names = [name for name, p in self.model.named_parameters() if p.requires_grad]
            tensors = {n: gathered[n].detach().cpu().contiguous().clone() for n in names if n in gathered}
        os.makedirs(output_dir, exist_ok=True)
        save_file(tensors, os.path.join(output_dir, TRAINABLE_FILE), metadata={"format": "pt"})
