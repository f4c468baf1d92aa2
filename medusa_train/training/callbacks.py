"""Trainer callbacks of medusa-train.

:class:`SealCheckpoints` makes the HF Trainer's ``checkpoint-N`` folders atomic: in ``on_save`` (fired on every rank
right after the Trainer wrote the checkpoint) it waits for every rank, marks the checkpoint complete with the sha256 of
each file and rotates old checkpoints (:mod:`medusa_train.training.checkpoints`). ``DrafterTrainer`` installs it as the
first callback. :class:`DiscardOverwritten` then deletes the run that ``overwrite=true`` set aside, once the first
checkpoint of the new run is sealed (:mod:`medusa_train.training.run_dir`).

:class:`ExitAfterStep` stops the process abruptly (``os._exit``: no cleanup, no final save) once a given optimizer step
has finished, to test that a killed run resumes to the same heads. ``medusa-train`` adds it when the environment
variable ``MEDUSA_TRAIN_EXIT_AFTER_STEP`` holds a step number, ``N:RANK`` for one rank alone (tests and
fault-injection drills only; every drill variable is in :mod:`medusa_train.runs.drills`).

:class:`StopOnSignal` turns SIGTERM or SIGUSR1 (SLURM's preemption and its ``--signal`` warning, ``scancel``) into a
sealed checkpoint at the end of the current optimizer step and an exit with
:data:`~medusa_train.runs.preemption.PREEMPTED_EXIT_CODE`, which ``launch/slurm.sbatch`` answers with a requeue; the
requeued run resumes from that checkpoint (what a preemption does at the other stages: :mod:`medusa_train.runs.preemption`).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from medusa_train.runs.drills import EXIT_AFTER_STEP, EXIT_CODE, SIGNAL_AT_STEP, count_and_rank
from medusa_train.runs.preemption import PREEMPTED_EXIT_CODE, STOP_SIGNALS, Stopped
from medusa_train.training import checkpoints
from medusa_train.training.process_group import ranks_max
from medusa_train.training.run_dir import RunPaths, discard_overwritten

log = logging.getLogger(__name__)

class Preempted(Stopped):
    """The run stopped on a signal after sealing a checkpoint: exit with
    :data:`~medusa_train.runs.preemption.PREEMPTED_EXIT_CODE` (no export)."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(signum)
        self.step = step

    def __str__(self) -> str:
        return (f"stopped on {self.signal_name} after step {self.step}, checkpoint sealed; run the same command with "
                f"resume=true to continue (exit code {PREEMPTED_EXIT_CODE})")


class SealCheckpoints(TrainerCallback):
    """Seal each checkpoint once every rank wrote its part (``on_save``, every rank).

    After a barrier, the main process (``args.should_save``) writes ``checkpoint-N``'s completeness marker
    (:func:`~medusa_train.training.checkpoints.mark_complete`: sizes, sha256 and the number of ranks) and deletes
    complete checkpoints older than the ``keep`` newest (:func:`~medusa_train.training.checkpoints.rotate`; None keeps
    all); a second barrier holds every rank until the checkpoint is sealed. A run killed before the marker is written
    leaves an incomplete folder that resuming skips. Other ``on_save`` callbacks must run after this one (a callback
    that stops the process there would otherwise leave the checkpoint unsealed).

    Args:
        keep: how many complete checkpoints to keep (the Trainer's own ``save_total_limit`` stays None: it would
            rotate before the new checkpoint is sealed).
    """

    def __init__(self, keep: int | None) -> None:
        self.keep = keep

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        from accelerate import PartialState

        processes = PartialState()
        processes.wait_for_everyone()  # every rank's files (DeepSpeed shards, RNG states) are written
        if args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            checkpoints.mark_complete(folder, state.global_step, world_size=processes.num_processes)
            checkpoints.rotate(args.output_dir, self.keep)
        processes.wait_for_everyone()


class DiscardOverwritten(TrainerCallback):
    """``overwrite=true``: the commit of the overwrite (:func:`~medusa_train.training.run_dir.discard_overwritten`)
    once this run has a complete checkpoint (``on_save``, main process, after :class:`SealCheckpoints` sealed it; a
    no-op once done, or when nothing was set aside).

    Args:
        paths: the run folder the Trainer checkpoints into (``paths.checkpoints``).
    """

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if args.should_save and checkpoints.latest_complete(self.paths.checkpoints) is not None:
            discard_overwritten(self.paths)


class ExitAfterStep(TrainerCallback):
    """Kill this process with exit code :data:`EXIT_CODE` right after optimizer step ``step`` (and its save, if any),
    on rank ``rank`` only (a rank dying alone, as from an OOM kill) or on every rank when None.

    ``on_step_end`` runs before the step's checkpoint is written, so the exit happens in ``on_save`` (after
    :class:`SealCheckpoints` sealed it) when the step is a save step and in ``on_step_end`` itself otherwise; either
    way no step after ``step`` runs.
    """

    def __init__(self, step: int, rank: int | None = None) -> None:
        if step < 1:
            raise ValueError(f"{EXIT_AFTER_STEP} must be a step >= 1, got {step}")
        self.step, self.rank = step, rank

    def _exit(self, args: TrainingArguments, state: TrainerState) -> None:
        if self.rank in (None, args.process_index):
            log.warning("exiting at step %d (%s)", state.global_step, EXIT_AFTER_STEP)
            os._exit(EXIT_CODE)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state.global_step > self.step or (state.global_step == self.step and not control.should_save):
            self._exit(args, state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state.global_step >= self.step:
            self._exit(args, state)


def exit_callback_from_env() -> ExitAfterStep | None:
    """:class:`ExitAfterStep` when ``MEDUSA_TRAIN_EXIT_AFTER_STEP`` holds ``N`` or ``N:RANK``, else None.

    Raises:
        ValueError: the variable is not of that form.
    """
    parsed = count_and_rank(EXIT_AFTER_STEP)
    return None if parsed is None else ExitAfterStep(*parsed)


class StopOnSignal(TrainerCallback):
    """Stop at the end of the optimizer step in which SIGTERM or SIGUSR1 arrived, after saving a checkpoint.

    The handler only records the signal. At each step's end every rank takes the largest signal number any rank
    received (one all-reduce of one integer: ranks may get the signal a step apart, and all must save at the same
    step or the checkpoint's collective calls hang); when one arrived, the Trainer saves (sealed by
    :class:`SealCheckpoints`) and stops, and :attr:`stopped_at` holds the step. A signal during the last step lets the
    run finish. The previous handlers are put back at the end of training (``on_train_end``).

    Args:
        signals: the signals handled (:data:`STOP_SIGNALS`).
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.received = 0
        self.stopped_at: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("received %s: saving a checkpoint at the end of this step, then stopping",
                    signal.Signals(signum).name)
        self.received = signum

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        signum = ranks_max(self.received, args.device)  # ranks may get the signal a step apart
        if signum and state.global_step < state.max_steps:
            self.received = signum
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class SignalAtStep(TrainerCallback):
    """Send SIGTERM to this process as optimizer step ``step`` begins (on rank ``rank`` only, or every rank when None):
    a preemption at a known step, for tests and drills. ``medusa-train`` adds it when ``MEDUSA_TRAIN_SIGNAL_AT_STEP``
    holds ``N`` or ``N:RANK``."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state.global_step + 1 == self.step and self.rank in (None, args.process_index):
            os.kill(os.getpid(), signal.SIGTERM)


def signal_callback_from_env() -> SignalAtStep | None:
    """:class:`SignalAtStep` when ``MEDUSA_TRAIN_SIGNAL_AT_STEP`` holds ``N`` or ``N:RANK``, else None.

    Raises:
        ValueError: the variable is not of that form.
    """
    parsed = count_and_rank(SIGNAL_AT_STEP)
    return None if parsed is None else SignalAtStep(*parsed)
