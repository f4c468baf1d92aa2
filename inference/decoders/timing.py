"""Drafting and verification time of tree decoding, summed over the steps of one decode.

A step's **drafting** time is its tree drafter's ``draft`` call (:mod:`medusa_train.models.tree_drafter`); its
**verification** time runs from the end of drafting to the end of the step: the tree pass, the acceptance rule, cache
compaction, the drafter's ``accept`` and the step's bookkeeping. Together they are the decode's time after the
prefill. On CUDA the marks are events, read once at the end, so timing adds no host synchronisation to a step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from medusa_train.tree.buffers import TreeBuffers
from medusa_train.models.tree_drafter import TreeDrafter


class StepTimes:
    """Marks around the drafter (through :meth:`timed`) and at each step's end (:meth:`step_done`).

    Args:
        device: where the decode runs (CUDA: events; otherwise ``time.perf_counter``).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.steps: list[tuple[Any, Any, Any]] = []  # (drafting starts, drafting ends, step ends)
        self._drafted: tuple[Any, Any] | None = None

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def timed(self, drafter: TreeDrafter) -> TreeDrafter:
        """``drafter`` with its ``draft`` calls timed (``start``, ``accept`` and ``select`` passed through untimed)."""
        return _TimedDrafter(drafter, self)

    def drafted(self, start: Any, end: Any) -> None:
        self._drafted = (start, end)

    def step_done(self) -> None:
        """Close the step whose drafting was timed last.

        Raises:
            RuntimeError: no drafting was timed since the last step.
        """
        if self._drafted is None:
            raise RuntimeError("step_done() without a timed draft: draft through StepTimes.timed(drafter)")
        self.steps.append((*self._drafted, self.mark()))
        self._drafted = None

    def totals(self) -> dict[str, float]:
        """``{"draft_time_s": float, "verify_time_s": float}`` over the closed steps."""
        if self.cuda:
            torch.cuda.synchronize()

            def seconds(a: Any, b: Any) -> float:
                return a.elapsed_time(b) / 1000.0
        else:
            def seconds(a: Any, b: Any) -> float:
                return b - a
        return {"draft_time_s": sum(seconds(s, d) for s, d, _ in self.steps),
                "verify_time_s": sum(seconds(d, e) for _, d, e in self.steps)}


class _TimedDrafter:
    def __init__(self, drafter: TreeDrafter, times: StepTimes) -> None:
        self.drafter = drafter
        self.times = times

    def start(self, features: dict[str, Tensor], tokens: Tensor, valid: Tensor) -> None:
        self.drafter.start(features, tokens, valid)

    def draft(self, root: Tensor, tree: TreeBuffers) -> Tensor:
        start = self.times.mark()
        tokens = self.drafter.draft(root, tree)
        self.times.drafted(start, self.times.mark())
        return tokens

    def draft_dynamic(self, root: Tensor, shape: Any) -> tuple[Tensor, TreeBuffers]:
        start = self.times.mark()
        tokens, tree = self.drafter.draft_dynamic(root, shape)
        self.times.drafted(start, self.times.mark())
        return tokens, tree

    def accept(self, tokens: Tensor, features: dict[str, Tensor], length: Tensor) -> None:
        self.drafter.accept(tokens, features, length)

    def select(self, keep: Tensor) -> None:
        self.drafter.select(keep)


__all__ = ["StepTimes"]
