"""Noise bounds for speed ratios: a paired bootstrap over the prompt turns of one run.

A speedup is a ratio of two speeds measured on the same prompt turns, interleaved: ``(sum of a's new tokens / sum of
a's wall time) / (the same for b)``. The turns differ in length and difficulty far more than the two decoders' runs
of one turn differ by chance, so the turns are resampled in pairs (both decoders' rows of a turn together), the ratio
is recomputed on each resample, and the interval is the central ``level`` share of those ratios (the percentile
bootstrap, Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13). It bounds the noise that comes from
which prompts were drawn and how each one's timing fell; it cannot see a machine that was slower for the whole run,
which is why every decoder is timed interleaved per prompt in one run.

"Beyond the noise": the interval of ``a / b`` excludes 1 (:attr:`Interval.separated`).

The resampling is seeded: the same rows give the same interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

LEVEL = 0.95  # the interval's coverage
RESAMPLES = 2000  # bootstrap resamples
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A ratio of speeds with its paired-bootstrap interval.

    Attributes:
        estimate: the ratio over all the turns (unitless).
        low: lower bound of the ``level`` interval; None with a single turn (no noise can be measured).
        high: upper bound; None with a single turn.
        level: coverage, e.g. 0.95.
        turns: how many prompt turns were paired.
    """

    estimate: float
    low: float | None
    high: float | None
    level: float
    turns: int

    @property
    def separated(self) -> bool:
        """Whether the interval excludes 1 (the two speeds differ beyond the measured noise); False without an
        interval."""
        return self.low is not None and (self.low > 1.0 or self.high < 1.0)

    def record(self) -> dict[str, Any]:
        """JSON-ready: ``{"estimate", "low", "high", "level", "turns", "separated"}``."""
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "level": self.level,
                "turns": self.turns, "separated": self.separated}

    def describe(self, spec: str = ".2f") -> str:
        """``1.18x [1.09, 1.27]`` (``[n/a]`` without an interval)."""
        return f"{self.estimate:{spec}}x {bounds_text(self.record(), spec)}"


def bounds_text(record: Mapping[str, Any], spec: str = ".2f") -> str:
    """``[1.09, 1.27]`` from an :meth:`Interval.record`, ``[n/a]`` when it has no interval (one turn)."""
    if record["low"] is None:
        return "[n/a]"
    return f"[{record['low']:{spec}}, {record['high']:{spec}}]"


def bootstrap_interval(columns: torch.Tensor, statistic: Callable[[torch.Tensor], torch.Tensor],
                       level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """A statistic of per-turn sums with its paired percentile-bootstrap interval.

    Args:
        columns: ``[k, turns]`` float64, the per-turn quantities that are summed (tokens, seconds, ...); a resample
            draws whole turns, every column of a turn together.
        statistic: maps the column sums ``[k, *batch]`` to the statistic ``[*batch]`` (e.g. a ratio of speeds).
        level: the interval's coverage, in (0, 1).
        resamples: bootstrap resamples (>= 1).
        seed: the resampling's seed.

    Raises:
        ValueError: no turn, ``level``/``resamples`` out of range, or a statistic that is not finite on all turns.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    turns = columns.shape[1]
    if turns == 0:
        raise ValueError("no turn to compare")
    estimate = float(statistic(columns.sum(dim=1)))
    if not math.isfinite(estimate):
        raise ValueError("the statistic is not finite over all turns (a speed needs wall time, a ratio tokens)")
    if turns == 1:  # one turn: nothing to resample
        return Interval(estimate, None, None, level, 1)
    picks = torch.randint(turns, (resamples, turns), generator=torch.Generator().manual_seed(seed))  # [R, turns]
    values = statistic(columns[:, picks].sum(dim=2))  # [R]
    values = values[torch.isfinite(values)]  # a resample of turns with no time on one side says nothing
    tail = (1.0 - level) / 2
    low, high = torch.quantile(values, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return Interval(estimate, min(low, estimate), max(high, estimate), level, turns)


def speed_ratio(sums: torch.Tensor) -> torch.Tensor:
    """``(sums[0] / sums[1]) / (sums[2] / sums[3])``: tokens over seconds of one side over the other's, ``[4, *b]``
    -> ``[*b]``."""
    return (sums[0] / sums[1]) / (sums[2] / sums[3])


def ratio_interval(a_tokens: Sequence[float], a_seconds: Sequence[float], b_tokens: Sequence[float],
                   b_seconds: Sequence[float], **kwargs: Any) -> Interval:
    """Speed of ``a`` over speed of ``b`` on the same turns, with its paired percentile-bootstrap interval.

    Args:
        a_tokens, a_seconds: per turn, ``a``'s new tokens and wall time (seconds), ``[turns]``.
        b_tokens, b_seconds: the same turns' for ``b``, in the same order.
        kwargs: ``level``, ``resamples``, ``seed`` of :func:`bootstrap_interval`.

    Returns:
        :class:`Interval`.

    Raises:
        ValueError: the four sequences differ in length, hold no turn, a side has no wall time or ``b`` no token over
            all turns, or ``level``/``resamples`` out of range.
    """
    lengths = {len(a_tokens), len(a_seconds), len(b_tokens), len(b_seconds)}
    if len(lengths) != 1:
        raise ValueError(f"the per-turn sequences differ in length: {sorted(lengths)}")
    columns = torch.tensor([a_tokens, a_seconds, b_tokens, b_seconds], dtype=torch.float64).reshape(4, -1)
    if columns.shape[1] and (columns[1].sum() <= 0 or columns[2].sum() <= 0 or columns[3].sum() <= 0):
        raise ValueError("a ratio of speeds needs wall time on both sides and tokens on the second")
    return bootstrap_interval(columns, speed_ratio, **kwargs)


def paired_interval(units: Sequence[Mapping[str, Mapping[str, Any]]], a: str, b: str, **kwargs: Any) -> Interval:
    """:func:`ratio_interval` of decoder ``a`` over decoder ``b`` from ``results.jsonl`` rows.

    Args:
        units: per prompt turn, ``{decoder: row}`` with ``new_tokens`` and ``wall_time_s`` (both decoders present).
        a, b: decoder names.
        kwargs: ``level``, ``resamples``, ``seed``.
    """
    def column(name: str, key: str) -> list[float]:
        return [float(u[name][key]) for u in units]

    return ratio_interval(column(a, "new_tokens"), column(a, "wall_time_s"), column(b, "new_tokens"),
                          column(b, "wall_time_s"), **kwargs)


__all__ = ["Interval", "LEVEL", "RESAMPLES", "SEED", "bootstrap_interval", "bounds_text", "paired_interval",
           "ratio_interval",
           "speed_ratio"]
