"""Trainer callbacks of medusa-train.

:class:`ExitAfterStep` stops the process abruptly (``os._exit``: no cleanup, no final save) once a given optimizer step
has finished, to test that a killed run resumes to the same heads. ``medusa-train`` adds it when the environment
variable ``MEDUSA_TRAIN_EXIT_AFTER_STEP`` holds a step number (tests and fault-injection drills only).
"""

from __future__ import annotations

import logging
import os

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger(__name__)

EXIT_ENV = "MEDUSA_TRAIN_EXIT_AFTER_STEP"
EXIT_CODE = 17


class ExitAfterStep(TrainerCallback):
    """Kill this process with exit code :data:`EXIT_CODE` right after optimizer step ``step`` (and its save, if any).

    ``on_step_end`` runs before the step's checkpoint is written, so the exit happens in ``on_save`` when the step is
    a save step and in ``on_step_end`` itself otherwise; either way no step after ``step`` runs.
    """

    def __init__(self, step: int) -> None:
        if step < 1:
            raise ValueError(f"{EXIT_ENV} must be a step >= 1, got {step}")
        self.step = step

    def _exit(self, state: TrainerState) -> None:
        log.warning("exiting at step %d (%s)", state.global_step, EXIT_ENV)
        os._exit(EXIT_CODE)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state.global_step > self.step or (state.global_step == self.step and not control.should_save):
            self._exit(state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if state.global_step >= self.step:
            self._exit(state)


def exit_callback_from_env() -> ExitAfterStep | None:
    """:class:`ExitAfterStep` when ``MEDUSA_TRAIN_EXIT_AFTER_STEP`` holds a step number, else None.

    Raises:
        ValueError: the variable is not a positive integer.
    """
    value = os.environ.get(EXIT_ENV)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{EXIT_ENV} must be a step number, got {value!r}")
    return ExitAfterStep(int(value))
