"""The process group's timeout (``trainer.timeout_minutes``): how long a rank waits in a collective for the others
before it fails, instead of transformers' 30-minute default.

Two ways it reaches the group, one value (:func:`timeout_seconds`):

- on GPUs (``ddp`` with nccl, DeepSpeed) the Trainer starts the group from ``TrainingArguments.ddp_timeout``
  (:func:`~medusa_train.training.arguments.training_arguments`);
- on the CPU (``use_cpu``, gloo) transformers 5 passes no timeout to the group it starts (``TrainingArguments.
  _setup_devices`` gives accelerate's ``PartialState`` only ``cpu`` and ``backend``), so :func:`start_cpu_group`
  starts the gloo group first, with the timeout; accelerate and DeepSpeed then use the group that exists.

A gloo collective that times out raises ``RuntimeError("... Timed out waiting 60000ms ...")`` on the waiting rank;
:func:`explain_timeout` re-raises it naming ``trainer.timeout_minutes``. An nccl collective that times out is caught
by torch's watchdog, which ends the process itself ("Watchdog caught collective operation timeout ... ran for N
milliseconds"): planned from torch's documentation, not measured here (no GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


def timeout_seconds(timeout_minutes: float) -> int:
    """``trainer.timeout_minutes`` in whole seconds (rounded up, at least 1): ``TrainingArguments.ddp_timeout``."""
    return max(1, math.ceil(timeout_minutes * 60))


def start_cpu_group(timeout_minutes: float, use_cpu: bool, backend: str | None, world_size: int) -> bool:
    """Under a launcher on the CPU, start the process group with the timeout (see the module docstring).

    Args:
        timeout_minutes: ``trainer.timeout_minutes``.
        use_cpu: the run trains on the CPU (``trainer.use_cpu`` or no CUDA).
        backend: ``trainer.ddp_backend`` (None: gloo).
        world_size: ``WORLD_SIZE``; 1 starts nothing.

    Returns:
        Whether this call started the group (False: one process, a GPU run, or a group already started).
    """
    if not use_cpu or world_size <= 1 or not torch.distributed.is_available() or torch.distributed.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_seconds(timeout_minutes))
    torch.distributed.init_process_group(backend=backend or "gloo", timeout=timeout)
    log.info("process group: %s over %d ranks, collectives time out after %s (trainer.timeout_minutes)",
             backend or "gloo", world_size, timeout)
    return True


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out (gloo's ``Timed out waiting``, torch's ``DistBackendError``
    or ``DistStoreError`` saying ``timed out``/``timeout``)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


@contextlib.contextmanager
def explain_timeout(timeout_minutes: float) -> Iterator[None]:
    """Within the block, a collective's timeout is re-raised as ``TimeoutError`` naming ``trainer.timeout_minutes``
    and what to do (the original error chained); other errors pass unchanged.

    Raises:
        TimeoutError: a rank waited longer than ``timeout_minutes`` for another.
    """
    try:
        yield
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        raise TimeoutError(
            f"rank {rank} waited more than trainer.timeout_minutes={timeout_minutes:g} for another rank in a "
            f"collective ({e}). Another rank is slower (self-distillation, the hidden-state cache or tokenization "
            "on one rank while the others wait) or has failed (see its log): raise trainer.timeout_minutes if the "
            "wait is expected") from e


def ranks_max(value: int, device: torch.device | str) -> int:
    """The largest ``value`` over all ranks (an all-reduce; ``value`` itself without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    on = device if torch.distributed.get_backend() == "nccl" else "cpu"
    total = torch.tensor([value], dtype=torch.int64, device=on)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
    return int(total.item())


def from_main(value: Any) -> Any:
    """``value`` as the main process (rank 0) holds it, on every rank: ``torch.distributed.broadcast_object_list``
    (a collective: every rank calls it), ``value`` itself without a process group. For small picklable decisions
    (a lock's token, the names of non-finite weights), not tensors."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
