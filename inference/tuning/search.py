"""Tree search: the ``medusa_choices`` that maximise expected accepted tokens for a node budget.

Model (Medusa paper, Sec. 2.3.3 "Optimized Tree Construction"; Sequoia, Chen et al. 2024, Sec. 3.1): head k's rank-i
candidate is right with probability ``acc[k][i]``, independently of the other heads. A node for path
``(i_0, ..., i_{d-1})`` is accepted iff every node on its path is right, which happens with probability
``prod_j acc[j][i_j]``; greedy verification accepts the deepest such node, and the ranks of one head are mutually
exclusive events (only one token can be the target's), so the expected number of tokens per step is

    E[tokens] = 1 + sum over nodes of prod_j acc[j][i_j]            (the 1 is the root / bonus token).

Every term is positive and a node's value never exceeds its parent's (accuracies are <= 1), so adding nodes in
decreasing order of value, each time the best node whose parent is already in the tree, gives a prefix-closed tree
and is optimal for every budget at once: the best n-node tree is the n most valuable nodes when values are
monotone along paths (ties broken by path order). :func:`greedy_tree` implements that with a heap. Sequoia's
dynamic program solves the same objective (its positional acceptance vector is our ``acc[k]`` with rank
exclusivity); without a depth or width constraint it returns the same trees, so it is not duplicated here.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from inference.tuning.replay import replayed_accept_length

Path = tuple[int, ...]


def check_accuracy_table(acc: Sequence[Sequence[float]], num_heads: int | None = None) -> list[list[float]]:
    """Validate ``acc[k][i]`` (head k, rank i, probabilities) and return it as lists of floats.

    Raises:
        ValueError: empty table, a value outside [0, 1], ragged rows, or ``num_heads`` given and different from
            the number of rows (the table was measured for other heads).
    """
    table = [[float(x) for x in row] for row in acc]
    if not table or not table[0]:
        raise ValueError("head accuracy table is empty: measure it with medusa-tune-tree first")
    if num_heads is not None and len(table) != num_heads:
        raise ValueError(
            f"head accuracy table has {len(table)} heads but the export has {num_heads} heads: "
            "re-measure head_accuracy.json for these heads"
        )
    width = len(table[0])
    for k, row in enumerate(table):
        if len(row) != width:
            raise ValueError(f"head accuracy table row {k} has {len(row)} ranks, row 0 has {width}")
        for i, x in enumerate(row):
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"head accuracy acc[{k}][{i}]={x} is not a probability in [0, 1]")
    return table


def path_value(acc: Sequence[Sequence[float]], path: Path) -> float:
    """Probability that the node for ``path`` is accepted: ``prod_j acc[j][path[j]]``."""
    value = 1.0
    for depth, rank in enumerate(path):
        value *= acc[depth][rank]
    return value


def expected_accept_length(acc: Sequence[Sequence[float]], medusa_choices: Sequence[Sequence[int]]) -> float:
    """Expected tokens per verification step of a tree: ``1 + sum_nodes path_value`` (see module docstring)."""
    return 1.0 + sum(path_value(acc, tuple(p)) for p in medusa_choices)


def greedy_tree(acc: Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """The best prefix-closed tree of ``num_nodes`` nodes (root excluded) for the accuracy table ``acc[K][R]``.

    Returns:
        ``medusa_choices`` in the order the nodes were added (so every prefix of the list is the best tree of its
        size, and parents come before children).

    Raises:
        ValueError: ``num_nodes < 1`` or a bad table.
    """
    table = check_accuracy_table(acc)
    if num_nodes < 1:
        raise ValueError(f"tree node budget must be >= 1, got {num_nodes}")
    num_heads, ranks = len(table), len(table[0])
    counter = itertools.count()  # tie-break: first pushed first, i.e. shallower and lower rank
    heap: list[tuple[float, int, Path]] = [(-table[0][i], next(counter), (i,)) for i in range(ranks)]
    heapq.heapify(heap)
    chosen: list[list[int]] = []
    while heap and len(chosen) < num_nodes:
        neg, _, path = heapq.heappop(heap)
        chosen.append(list(path))
        if len(path) < num_heads:
            for i in range(ranks):
                child = path + (i,)
                heapq.heappush(heap, (neg * table[len(path)][i], next(counter), child))
    return chosen


def best_tree_for_latency(
    acc: Sequence[Sequence[float]],
    latency_ms: dict[int, float],
    max_nodes: int | None = None,
    target_ranks: Sequence[Sequence[Sequence[int]]] | None = None,
) -> tuple[list[list[int]], dict[int, dict[str, float]]]:
    """Choose the tree size that maximises accepted tokens per second.

    The trees are :func:`greedy_tree`'s (best by the formula for every size); with ``target_ranks`` each size is
    scored by its replayed mean accepted tokens (:mod:`inference.tuning.replay`, what the decoder will measure),
    else by the formula.

    Args:
        acc: head accuracy table ``[K][R]``.
        latency_ms: measured verification latency (ms) of one target forward pass over ``n`` tree tokens
            (n = nodes + root), for the sizes that were measured; sizes in between are interpolated linearly.
            Timing noise only ever adds time, and a pass over more tokens cannot cost less, so the profile is first
            replaced by its lower monotone envelope (:func:`monotone_envelope`).
        max_nodes: optional cap on nodes (root excluded).
        target_ranks: ``[prompt][state][head]`` from :func:`inference.tuning.accuracy.measure_head_accuracy`.

    Returns:
        ``(medusa_choices, table)`` where ``table[n] = {"expected_tokens", "latency_ms", "tokens_per_s"}`` (and
        ``"replayed_tokens"`` with ``target_ranks``; ``tokens_per_s`` then uses it) for every candidate size n
        (tokens including the root).
    """
    if not latency_ms:
        raise ValueError("latency profile is empty: measure it with medusa-tune-tree first")
    latency_ms = monotone_envelope(latency_ms)
    sizes = sorted(latency_ms)
    largest = sizes[-1] - 1
    if max_nodes is not None:
        largest = min(largest, max_nodes)
    if largest < 1:
        raise ValueError(f"latency profile must cover trees of at least 2 tokens, got sizes {sizes}")
    full = greedy_tree(acc, largest)
    table: dict[int, dict[str, float]] = {}
    best_n, best_rate = 1, -1.0
    expected = 1.0
    for n_nodes in range(1, len(full) + 1):
        expected += path_value(acc, tuple(full[n_nodes - 1]))
        lat = interpolate(latency_ms, n_nodes + 1)
        row = {"expected_tokens": expected, "latency_ms": lat}
        if target_ranks is not None:
            row["replayed_tokens"] = replayed_accept_length(target_ranks, full[:n_nodes])
        rate = row.get("replayed_tokens", expected) / lat * 1000.0
        table[n_nodes + 1] = {**row, "tokens_per_s": rate}
        if rate > best_rate:
            best_n, best_rate = n_nodes, rate
    return full[:best_n], table


def monotone_envelope(latency_ms: dict[int, float]) -> dict[int, float]:
    """``{n: min(latency[m] for measured m >= n)}``: the largest non-decreasing profile below the measurement (a
    size measured slower than a larger one was slowed by noise). Keys may be strings (JSON); returned as ints."""
    pts = sorted((int(k), float(v)) for k, v in latency_ms.items())
    out: dict[int, float] = {}
    lowest = float("inf")
    for n, value in reversed(pts):
        lowest = min(lowest, value)
        out[n] = lowest
    return dict(sorted(out.items()))


def interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear interpolation of ``points`` (size -> value) at ``x``, clamped to the measured range."""
    pts = {int(k): float(v) for k, v in points.items()}  # JSON keys arrive as strings
    xs = sorted(pts)
    ys = [pts[k] for k in xs]
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]
