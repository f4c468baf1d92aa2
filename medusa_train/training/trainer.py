"""The HF Trainer, taught to train Medusa heads on a frozen base model.

The Trainer's model is the heads alone (:class:`~medusa_train.drafters.medusa.heads.MedusaHeads` or
:class:`~medusa_train.drafters.hydra.heads.HydraHeads`): the optimizer, DDP, DeepSpeed
ZeRO sharding and checkpoints only ever see head parameters, and the frozen base (kept beside the Trainer, in
:class:`~medusa_train.training.step.FrozenBase`) runs under ``no_grad`` in :meth:`DrafterTrainer.compute_loss`, or
not at all when batches come from the hidden-state cache. What changes from the stock Trainer:

- ``compute_loss``: the Medusa loss (:mod:`medusa_train.training.losses`), normalised by the labelled tokens of the
  whole optimizer step across ranks and accumulation steps (the Trainer's ``num_items_in_batch``), so any split of
  one global batch over ranks and accumulation steps gives the same gradient.
- ``log``: per-head loss, top-1 and top-5 accuracy and tokens per second, summed over ranks.
- ``evaluation_loop``: the same per-head metrics for evaluations run during training.
- ``save_model`` (the Trainer's first step of writing a checkpoint, on every rank): refuses non-finite trainable
  weights before any file of the checkpoint is written, then saves as the stock Trainer does.
- checkpoints are sealed by :class:`~medusa_train.training.callbacks.SealCheckpoints`, the first ``on_save``
  callback: once every rank saved, the main process marks the checkpoint complete and rotates old ones
  (:mod:`medusa_train.training.checkpoints`). Resuming is the stock Trainer's (a non-``PreTrainedModel``'s
  ``model.safetensors`` is loaded non-strictly; DeepSpeed through its engine).
- stops (:class:`TrainingStopped`, with the step and a hint) instead of training on: a non-finite loss (checked at
  every micro-batch, after its backward pass and before the optimizer step, so the weights stay as they were), a
  non-finite trainable weight (checked on every rank before each checkpoint is written, so none holds NaN), and a
  diverged head: one whose logged mean loss is over :data:`DIVERGED_FACTOR` times ``ln V'`` (what a uniform guess
  over its V' tokens costs, which a freshly initialised head is far below).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from medusa_train.training.callbacks import SealCheckpoints
from medusa_train.training.metrics import HeadMetrics
from medusa_train.training.step import FrozenBase, LossSpec, heads_on_batch, real_tokens

DIVERGED_FACTOR = 10.0


class TrainingStopped(RuntimeError):
    """Training stopped before it spoiled the weights: a non-finite loss or weight, or a diverged head."""


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity."""
    return [name for name, t in named if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter (its partition under DeepSpeed ZeRO-3, where ``param`` itself is empty)."""
    return getattr(param, "ds_tensor", param)


class DrafterTrainer(Trainer):
    """``Trainer`` whose ``model`` is the heads; the frozen base and the loss settings are given beside it.

    Args:
        frozen_base: the base model's backbone and lm_head, on ``args.device`` (None for a model that runs the base
            itself, see :class:`~medusa_train.training.joint_trainer.JointTrainer`).
        loss_spec: target, decay and head-vocabulary settings.
        keep_checkpoints: how many complete checkpoints to keep (the Trainer's own ``save_total_limit`` must be None,
            rotation happens after marking, in :class:`~medusa_train.training.callbacks.SealCheckpoints`).
        **kwargs: ``Trainer`` arguments (``model`` = the heads, ``args``, datasets, ``data_collator``, callbacks).
    """

    # compute_loss divides by the step's labelled-token count itself (see the module docstring).
    loss_is_scaled_for_ga = True

    def __init__(
        self, *, frozen_base: FrozenBase | None, loss_spec: LossSpec, keep_checkpoints: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if self.args.save_total_limit is not None:
            raise ValueError("pass keep_checkpoints instead of TrainingArguments.save_total_limit (rotation must "
                             "wait until a checkpoint is complete)")
        self.frozen_base = frozen_base
        self.loss_spec = loss_spec
        # First of all callbacks: every other on_save (ExitAfterStep, trackers, the caller's) sees a sealed checkpoint.
        self.callback_handler.callbacks.insert(0, SealCheckpoints(keep_checkpoints))
        num_heads = self.model.spec.num_heads
        self.head_metrics = {"train": HeadMetrics(num_heads), "eval": HeadMetrics(num_heads)}
        # Ask the Trainer to count the labelled tokens of each optimizer step over all its micro-batches and ranks
        # (num_items_in_batch); it does so for models whose forward takes loss keyword arguments.
        self.model_accepts_loss_kwargs = True

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Medusa loss of the heads on one micro-batch (see the module docstring for the normalisation)."""
        out = heads_on_batch(model, self.frozen_base, inputs, self.loss_spec, normalizer=num_items_in_batch)
        loss = self._record_and_scale(out.loss, out, model, inputs, num_items_in_batch)
        # evaluation reads the loss alone (prediction_loss_only): the heads' logits are never held whole
        return (loss, {}) if return_outputs else loss

    def _record_and_scale(self, loss: torch.Tensor, heads_out: Any, model: nn.Module, inputs: dict[str, Any],
                          num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
        """Add the heads' metrics to this phase's sums; return ``loss`` as the backward pass needs it."""
        self.head_metrics[self.phase(model)].add(heads_out, tokens=real_tokens(inputs))
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            # DDP and DeepSpeed average gradients over ranks; the loss is already divided by the global count.
            loss = loss * self.accelerator.num_processes
        return loss

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The stock step (forward, backward), then a stop on a non-finite loss before the optimizer can use it."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not bool(torch.isfinite(loss).all()):
            self._stop(self.state.global_step + 1, f"the loss is {float(loss)}; the optimizer step was not taken, so "
                       "the weights and the last checkpoint are as they were")
        return loss

    def _stop(self, step: int, what: str) -> None:
        """Raise :class:`TrainingStopped` at optimizer step ``step``, with the way out."""
        raise TrainingStopped(
            f"training stopped at step {step}: {what}. No export was written. Lower trainer.learning_rate (now "
            f"{self.args.learning_rate:g}; Medusa trains heads at 1e-3) or check the data, and start again with "
            "overwrite=true (resume=true would keep the run's learning rate)")

    def _check_divergence(self, logs: dict[str, float]) -> None:
        vocab = self.loss_spec.vocab_size if self.loss_spec.token_map is None else self.loss_spec.token_map.numel()
        limit = DIVERGED_FACTOR * math.log(vocab)
        for k in range(self.model.spec.num_heads):
            loss = logs.get(f"head{k}/loss")
            if loss is not None and not loss <= limit:  # NaN fails the comparison too
                self._stop(self.state.global_step,
                           f"head {k}'s mean loss over the last {self.args.logging_steps} steps is {loss:.4g}, over "
                           f"{DIVERGED_FACTOR:g} x ln({vocab}) = {limit:.1f} (ten times what a uniform guess costs): "
                           "training diverged, and checkpoints written since it started may hold diverged weights")

    def _check_finite_weights(self, model: nn.Module) -> None:
        """Every rank, before a checkpoint: stop if any rank holds a non-finite trainable weight."""
        bad = nonfinite_names((n, _local(p).detach()) for n, p in model.named_parameters() if p.requires_grad)
        flag = self._reduce_sum(torch.tensor([float(len(bad))], device=self.args.device))
        if float(flag.sum()) > 0:
            shown = ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else "") if bad else "on another rank"
            self._stop(self.state.global_step,
                       f"trainable weights are not finite ({shown}); this checkpoint was not written")

    @staticmethod
    def phase(model: nn.Module) -> str:
        return "train" if model.training else "eval"

    def _reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return x
        return self.accelerator.reduce(x.to(self.args.device), reduction="sum")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add per-head metrics and tokens/s (all ranks) to each training log; every rank calls this."""
        if "loss" in logs:
            train = self.head_metrics["train"]
            logs = {**logs, **train.summary(self._reduce_sum)}
            train.reset()
            self._check_divergence(logs)  # the same reduced values on every rank: all ranks stop together
        super().log(logs, start_time)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The stock loop, plus per-head ``eval_head{k}/top1`` etc. summed over ranks."""
        metrics = self.head_metrics["eval"]
        metrics.reset()
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        output.metrics.update(
            {k: v for k, v in metrics.summary(self._reduce_sum, prefix=f"{prefix}_").items() if "tokens_per" not in k}
        )
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank: stop (:class:`TrainingStopped`) if any rank holds a non-finite trainable weight, before a file
        is written; then the stock save (the Trainer calls this first when it writes a checkpoint)."""
        self._check_finite_weights(self.model)
        super().save_model(output_dir, _internal_call)
