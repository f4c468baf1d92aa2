"""Per-head loss and top-1/top-5 accuracy, summed over batches and reduced over ranks; tokens per second."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from medusa_train.training.losses import HeadLossOutput


class HeadMetrics:
    """Running sums of :class:`HeadLossOutput` for K heads, plus the tokens seen since the last :meth:`reset`.

    ``reduce`` (a tensor -> the same tensor summed over ranks, e.g. ``accelerator.reduce(x, "sum")``) is applied in
    :meth:`summary`, so every rank must call :meth:`summary` at the same points.
    """

    def __init__(self, num_heads: int) -> None:
        self.num_heads = num_heads
        self.reset()

    def reset(self) -> None:
        # rows: loss, top-1 hits, top-5 hits, counted positions; column K: real input tokens. Kept on the device of
        # the batches so that adding never waits for the accelerator.
        self.sums = torch.zeros(4, self.num_heads + 1, dtype=torch.float64)
        self.started = time.perf_counter()

    def add(self, out: HeadLossOutput, tokens: torch.Tensor | int = 0) -> None:
        """Add one batch's sums and its count of real (non-padding) input tokens (a tensor or an int)."""
        stacked = torch.stack([out.loss_sum, out.correct_top1, out.correct_top5, out.count]).detach()
        if self.sums.device != stacked.device:
            self.sums = self.sums.to(stacked.device)
        self.sums[:, : self.num_heads] += stacked.to(torch.float64)
        self.sums[0, self.num_heads] += torch.as_tensor(tokens, dtype=torch.float64, device=stacked.device)

    def summary(
        self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, prefix: str = ""
    ) -> dict[str, float]:
        """``{prefix}head{k}/loss``, ``/top1``, ``/top5`` for each head, and ``{prefix}tokens_per_second``.

        Heads with no counted position are left out. Tokens per second is over all ranks since the last reset.
        """
        sums = self.sums if reduce is None else reduce(self.sums)
        sums = sums.cpu()
        tokens = float(sums[0, self.num_heads])
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        logs: dict[str, float] = {}
        for k in range(self.num_heads):
            n = float(sums[3, k])
            if n == 0:
                continue
            logs[f"{prefix}head{k}/loss"] = round(float(sums[0, k]) / n, 4)
            logs[f"{prefix}head{k}/top1"] = round(float(sums[1, k]) / n, 4)
            logs[f"{prefix}head{k}/top5"] = round(float(sums[2, k]) / n, 4)
        if tokens:
            logs[f"{prefix}tokens_per_second"] = round(tokens / elapsed, 1)
        return logs

    def table(self) -> dict[str, object]:
        """The accuracy table: ``{"top1": [K], "top5": [K], "loss": [K], "positions": [K]}`` (this rank's sums)."""
        sums = self.sums[:, : self.num_heads].cpu()
        n = sums[3].clamp_min(1)
        return {
            "top1": [round(float(x), 6) for x in sums[1] / n],
            "top5": [round(float(x), 6) for x in sums[2] / n],
            "loss": [round(float(x), 6) for x in sums[0] / n],
            "positions": [int(x) for x in sums[3]],
        }


def format_table(table: dict[str, object]) -> str:
    """A small text table, one row per head: ``head  top-1  top-5  loss  positions``."""
    rows = ["head  top-1   top-5   loss     positions"]
    for k, (t1, t5, loss, n) in enumerate(zip(table["top1"], table["top5"], table["loss"], table["positions"])):
        rows.append(f"{k:>4}  {t1:6.4f}  {t5:6.4f}  {loss:7.4f}  {n:>9}")
    return "\n".join(rows)
