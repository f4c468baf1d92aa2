"""PNG plots of an evaluation: speedup by category, the distribution of accepted lengths, per-head accuracy.

Drawn with matplotlib's object API on an Agg canvas (no pyplot state, no display needed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from inference.evaluation.eval_config import BASELINE
from inference.evaluation.summary import OVERALL
from inference.registry import decoder_names
from medusa_train.files.atomic import atomic_write

log = logging.getLogger(__name__)

SPEEDUP_PNG = "speedup_by_category.png"
ACCEPTED_PNG = "accepted_lengths.png"
HEAD_ACCURACY_PNG = "head_accuracy.png"


def decoder_color(name: str) -> str:
    """One colour per decoder, the same in every plot (matplotlib's cycle colours by registry order)."""
    names = decoder_names()
    return f"C{names.index(name) % 10}" if name in names else "C9"


def _grouped_bars(ax: Any, groups: list[str], series: dict[str, list[float]], rotate: bool) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width=width, label=label, color=decoder_color(label))
    if rotate:
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    else:
        ax.set_xticks(range(len(groups)), groups)


def plot_speedup_by_category(by_category: dict[str, dict[str, dict[str, Any]]], path: str | Path,
                             baseline: str = BASELINE) -> Path | None:
    """Bars of each decoder's speedup over the baseline, per category and overall (a line marks 1.0).

    Returns:
        The PNG's path, or None when there is nothing but the baseline.
    """
    categories = [c for c in by_category if c != OVERALL] + [OVERALL]
    names = [n for n in by_category.get(OVERALL, {}) if n != baseline]
    if not names:
        return None
    series = {n: [(by_category[c].get(n, {}).get("speedup") or 0.0) for c in categories] for n in names}
    fig = Figure(figsize=(max(6.0, 1.1 * len(categories)), 4.0), layout="constrained")
    ax = fig.subplots()
    _grouped_bars(ax, categories, series, rotate=True)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel(f"speedup over {baseline} (tokens/s ratio)")
    ax.set_title("Speedup by category")
    ax.legend(fontsize="small")
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    return Path(path)


def plot_accepted_lengths(histogram: dict[str, dict[int, int]], path: str | Path) -> Path | None:
    """For each decoder, the share of decoding passes that kept 1, 2, ... tokens.

    Returns:
        The PNG's path, or None when no decoder made a decoding pass.
    """
    histogram = {n: h for n, h in histogram.items() if sum(h.values())}
    if not histogram:
        return None
    lengths = sorted({length for h in histogram.values() for length in h})
    series = {n: [h.get(length, 0) / sum(h.values()) for length in lengths] for n, h in histogram.items()}
    fig = Figure(figsize=(max(6.0, 0.6 * len(lengths)), 4.0), layout="constrained")
    ax = fig.subplots()
    _grouped_bars(ax, [str(length) for length in lengths], series, rotate=False)
    ax.set_xlabel("tokens kept by one decoding pass (accepted drafts + 1)")
    ax.set_ylabel("share of decoding passes")
    ax.set_title("Accepted lengths")
    ax.legend(fontsize="small")
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    return Path(path)


def plot_head_accuracy(head_accuracy: dict[str, Any], path: str | Path) -> Path:
    """Cumulative top-i accuracy of each Medusa head (``head_accuracy.json``'s ``acc[k][i]``).

    Raises:
        ValueError: ``acc`` missing or empty.
    """
    acc = head_accuracy.get("acc")
    if not acc or not all(acc):
        raise ValueError("head_accuracy has no 'acc' table (acc[k][i]: head k's rank-i accuracy)")
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    ax = fig.subplots()
    for k, row in enumerate(acc):
        cumulative = [sum(row[: i + 1]) for i in range(len(row))]
        ax.plot(range(1, len(row) + 1), cumulative, marker="o", label=f"head {k} (token t+{k + 2})")
    ax.set_xticks(range(1, max(len(row) for row in acc) + 1))
    ax.set_xlabel("top-i candidates")
    ax.set_ylabel("accuracy (the base model's token among them)")
    ax.set_ylim(0.0, 1.0)
    ax.set_title("Medusa head accuracy")
    ax.legend(fontsize="small")
    atomic_write(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    return Path(path)


def write_plots(out_dir: str | Path, by_category: dict[str, dict[str, dict[str, Any]]],
                histogram: dict[str, dict[int, int]], head_accuracy: dict[str, Any] | None) -> list[Path]:
    """All plots that have data, into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    written = [plot_speedup_by_category(by_category, out / SPEEDUP_PNG),
               plot_accepted_lengths(histogram, out / ACCEPTED_PNG)]
    if head_accuracy is not None:
        written.append(plot_head_accuracy(head_accuracy, out / HEAD_ACCURACY_PNG))
    else:
        log.info("no head_accuracy.json in the export (run medusa-tune-tree): per-head accuracy plot skipped")
    return [p for p in written if p is not None]


__all__ = ["plot_accepted_lengths", "plot_head_accuracy", "plot_speedup_by_category", "write_plots"]
