"""Fault-injection drills: environment variables that make a run fail at a known point (tests and drills only).

Each holds ``N`` or ``N:RANK`` (that rank alone; every rank when RANK is left out):

- ``MEDUSA_TRAIN_EXIT_AFTER_STEP``: exit with :data:`EXIT_CODE` right after optimizer step N (and its save)
  (:class:`~medusa_train.training.callbacks.ExitAfterStep`);
- ``MEDUSA_TRAIN_SIGNAL_AT_STEP``: SIGTERM to the process as step N begins, a preemption
  (:class:`~medusa_train.training.callbacks.SignalAtStep`);
- ``MEDUSA_TRAIN_EXIT_AT_CACHE_BLOCK``: exit with :data:`EXIT_CODE` as the N-th hidden-cache block this rank builds
  for a split begins (the train split is built first; the N - 1 before it sealed;
  :func:`~medusa_train.training.hidden_cache.build_hidden_cache`);
- ``MEDUSA_TRAIN_EXIT_AT_DISTILL_BATCH``: exit with :data:`EXIT_CODE` as the N-th self-distillation batch of this
  rank begins (the records of the N - 1 before it flushed; :func:`~medusa_train.data.self_distill.self_distill`).

An exit is ``os._exit``: no cleanup, no final save, as an OOM kill or ``kill -9`` leaves a rank.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

EXIT_AFTER_STEP = "MEDUSA_TRAIN_EXIT_AFTER_STEP"
SIGNAL_AT_STEP = "MEDUSA_TRAIN_SIGNAL_AT_STEP"
EXIT_AT_CACHE_BLOCK = "MEDUSA_TRAIN_EXIT_AT_CACHE_BLOCK"
EXIT_AT_DISTILL_BATCH = "MEDUSA_TRAIN_EXIT_AT_DISTILL_BATCH"
EXIT_CODE = 17


def count_and_rank(name: str) -> tuple[int, int | None] | None:
    """``(N, RANK or None)`` from the variable ``name`` holding ``N`` or ``N:RANK``; None when it is unset or empty.

    Raises:
        ValueError: another value (the variable named).
    """
    value = os.environ.get(name)
    if not value:
        return None
    count, _, rank = value.partition(":")
    if not count.isdigit() or int(count) < 1 or (rank and not rank.isdigit()):
        raise ValueError(f"{name} must be a count >= 1, optionally ':RANK' (e.g. 3 or 3:1), got {value!r}")
    return int(count), int(rank) if rank else None


def check_drills() -> None:
    """Parse every drill variable, so a bad one fails at the start of a run, not hours into it.

    Raises:
        ValueError: a variable is not ``N`` or ``N:RANK`` (named).
    """
    for name in (EXIT_AFTER_STEP, SIGNAL_AT_STEP, EXIT_AT_CACHE_BLOCK, EXIT_AT_DISTILL_BATCH):
        count_and_rank(name)


def exit_if_drilled(name: str, count: int, rank: int) -> None:
    """``os._exit(EXIT_CODE)`` when the drill ``name`` asks for it at ``count`` (1-based) on ``rank``.

    Raises:
        ValueError: the variable is not ``N`` or ``N:RANK``.
    """
    parsed = count_and_rank(name)
    if parsed is not None and parsed[0] == count and parsed[1] in (None, rank):
        log.warning("rank %d exiting at %s=%d (a fault-injection drill)", rank, name, count)
        logging.shutdown()
        os._exit(EXIT_CODE)


__all__ = ["EXIT_AFTER_STEP", "EXIT_AT_CACHE_BLOCK", "EXIT_AT_DISTILL_BATCH", "EXIT_CODE", "SIGNAL_AT_STEP",
           "check_drills", "count_and_rank", "exit_if_drilled"]
