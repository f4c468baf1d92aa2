"""Stopping on a preemption: SIGTERM or SIGUSR1 (SLURM's preemption and its ``--signal`` warning, ``scancel``,
torchrun stopping the ranks of a failed run) stops the stage medusa-train is in with what it finished kept, and the
process exits with :data:`PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL), which ``launch/slurm.sbatch`` answers with a
requeue; the rerun goes on from what was kept.

- self-distillation: the batch of replies being generated is discarded, every record written is kept
  (:class:`~medusa_train.data.self_distill.DistillStopped`);
- the hidden-cache build: the block being written is discarded, every sealed block kept
  (:class:`~medusa_train.training.hidden_cache.CacheBuildStopped`);
- training: a sealed checkpoint at the end of the current optimizer step
  (:class:`~medusa_train.training.callbacks.StopOnSignal`, :class:`~medusa_train.training.callbacks.Preempted`).

The first two stop where the signal finds them (:func:`stop_on_signals`): what they write is made whole elsewhere (a
block through a temporary file, a record by its own line and checksum), so nothing half done is kept.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): stopped on a signal, work kept, run again to resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Stopped(SystemExit):
    """A stage stopped on ``signum`` (one of :data:`STOP_SIGNALS`): the process exits with
    :data:`PREEMPTED_EXIT_CODE`; subclasses say what was kept (``str()``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class SignalStop:
    """What :func:`stop_on_signals` yields: its handler, and :meth:`held` for a write that must end whole."""

    def __init__(self, stopped: Callable[[int], Stopped], warning: str) -> None:
        self._stopped, self._warning = stopped, warning
        self._holding = 0
        self.pending: int | None = None  # a signal that arrived inside held(), raised at its end

    def handle(self, signum: int, frame: Any) -> None:
        log.warning(self._warning, signal.Signals(signum).name)
        if self._holding:
            self.pending = signum
            return
        raise self._stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Within: a stop signal waits for the block's end (a record being appended), then stops."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if not self._holding and self.pending is not None:
            raise self._stopped(self.pending)


@contextmanager
def stop_on_signals(stopped: Callable[[int], Stopped], warning: str) -> Iterator[SignalStop]:
    """Within: SIGTERM and SIGUSR1 log ``warning`` (``%s``: the signal's name) and raise ``stopped(signum)`` where
    the main thread is (so the ``finally`` of a write cleans up), or at the end of a :meth:`SignalStop.held` block
    it is in; the previous handlers are put back after. Off the main thread (where Python cannot set handlers)
    nothing changes.

    Args:
        stopped: the exception for a signal number (a :class:`Stopped`, which exits with 75).
    """
    stop = SignalStop(stopped, warning)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handle) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = ["PREEMPTED_EXIT_CODE", "STOP_SIGNALS", "SignalStop", "Stopped", "stop_on_signals"]
