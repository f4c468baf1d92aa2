"""The tuned tree files of an export folder: their names and their one reader.

``medusa-tune-tree`` writes them beside the heads (:mod:`inference.tuning.tune`); decoders, evaluation,
publishing and the benchmarks read them through :func:`read_tree_files` (or :func:`read_latency_profile` for a
profile reused by another export's tuning run).

- ``medusa_choices.json``: the tree, a prefix-closed list of rank paths (Medusa's ``medusa_choices``).
- ``head_accuracy.json``: ``acc[k][i]``, head k's rank-i accuracy on held-out continuations, with the prompts used.
- ``latency_profile.json``: verification latency in ms by tree size (``latency_ms``), the device, the dtype and the
  kernels it was measured on.
- ``dynamic_tree.json`` (drafters that grow an EAGLE-2 dynamic tree, :mod:`medusa_train.tree.dynamic`): the shape
  ``depth``, ``topk``, ``total`` chosen by decoding, its ``tokens_per_s`` and ``mean_accepted_tokens`` on the tuning
  prompts (null when it was not decoded), and ``chosen`` (how: :mod:`inference.tuning.dynamic`).
- ``composite_tree.json``: the composite tree's budget split (``nodes``, ``lookup_length``, ``lookup_matches``,
  ``max_matching_ngram_size``, :class:`medusa_train.tree.composite.CompositeTree`), the heads' nodes beside the
  lookup (``heads_nodes``), the heads' tree of the whole budget best node first (``medusa_choices``), its speed and
  τ on the tuning prompts (null when not decoded) and ``chosen`` (:mod:`inference.tuning.composite`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from medusa_train.files.text_files import read_text

CHOICES_FILE = "medusa_choices.json"
ACCURACY_FILE = "head_accuracy.json"
LATENCY_FILE = "latency_profile.json"
DYNAMIC_TREE_FILE = "dynamic_tree.json"
COMPOSITE_FILE = "composite_tree.json"
TREE_FILES = {"medusa_choices": CHOICES_FILE, "head_accuracy": ACCURACY_FILE, "latency_profile": LATENCY_FILE,
              "dynamic_tree": DYNAMIC_TREE_FILE, "composite_tree": COMPOSITE_FILE}
_UNBOUNDED = 1 << 62  # no bound on ranks when the heads' vocabulary is not known


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}; run medusa-tune-tree again to rewrite it") from e


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_medusa_choices(choices: Any, path: Path, num_heads: int | None, head_vocab: int | None) -> None:
    """Check ``medusa_choices.json``: a non-empty, prefix-closed list of distinct rank paths, each at most
    ``num_heads`` deep with ranks in ``[0, head_vocab)`` (the heads' output vocabulary; unchecked when None).

    Raises:
        ValueError: the file and the offending entry named
            (:func:`medusa_train.tree.buffers.validate_medusa_choices`'s rules).
    """
    from medusa_train.tree.buffers import validate_medusa_choices

    paths = choices if isinstance(choices, list) else []
    depth = num_heads if num_heads is not None else max((len(p) for p in paths if isinstance(p, list)), default=1)
    try:
        validate_medusa_choices(choices, max(depth, 1), head_vocab or _UNBOUNDED)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (run medusa-tune-tree again to rewrite it)") from e


def _check_object(data: Any, path: Path, fix: str) -> None:
    """``data`` (a tuned file's parsed JSON) is an object, else ``ValueError`` naming ``path`` and ``fix``."""
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}; {fix}")


def check_head_accuracy(data: Any, path: Path, num_heads: int | None) -> None:
    """Check ``head_accuracy.json``: an object whose ``acc`` holds one non-empty list of accuracies in [0, 1] per
    head (``num_heads`` of them when given).

    Raises:
        ValueError: the file and the field named.
    """
    fix = "run medusa-tune-tree again to rewrite it"
    _check_object(data, path, fix)
    acc = data.get("acc")
    if not isinstance(acc, list) or not acc or not all(isinstance(row, list) and row for row in acc):
        raise ValueError(f"{path}: 'acc' must be a non-empty list of non-empty lists (acc[k][i]: head k's rank-i "
                         f"accuracy), got {str(acc)[:80]}; {fix}")
    if num_heads is not None and len(acc) != num_heads:
        raise ValueError(f"{path}: 'acc' has {len(acc)} rows but the export has {num_heads} heads; {fix}")
    for k, row in enumerate(acc):
        for i, v in enumerate(row):
            if not _number(v) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{path}: acc[{k}][{i}] = {v!r}: accuracies lie in [0, 1]; {fix}")


def check_latency_profile(data: Any, path: Path) -> dict[str, Any]:
    """Check ``latency_profile.json`` and return it with ``latency_ms`` keyed by int tree size: an object with
    ``device`` and ``dtype`` (strings) and ``latency_ms`` (tree size >= 1 -> finite milliseconds > 0, not empty).

    Raises:
        ValueError: the file and the field named.
    """
    fix = "run medusa-tune-tree again to measure it"
    _check_object(data, path, fix)
    missing = [k for k in ("latency_ms", "device", "dtype") if k not in data]
    if missing:
        raise ValueError(f"{path} has no {missing}; {fix}")
    for key in ("device", "dtype"):
        if not isinstance(data[key], str):
            raise ValueError(f"{path}: {key} must be a string, got {data[key]!r}; {fix}")
    latency = data["latency_ms"]
    if not isinstance(latency, dict) or not latency:
        raise ValueError(f"{path}: latency_ms must map tree sizes to milliseconds, got {str(latency)[:80]}; {fix}")
    out: dict[int, float] = {}
    for size, ms in latency.items():
        if not (isinstance(size, str) and size.isdigit() and int(size) >= 1) or not _number(ms) or ms <= 0:
            raise ValueError(f"{path}: latency_ms[{size!r}] = {ms!r}: sizes must be integers >= 1 and latencies "
                             f"finite milliseconds > 0; {fix}")
        out[int(size)] = float(ms)
    return {**data, "latency_ms": out}


def _check_timed(data: dict[str, Any], path: Path, fix: str) -> None:
    """A decoded choice's ``tokens_per_s`` and ``mean_accepted_tokens`` (finite numbers > 0, or null when nothing
    was decoded) and its ``chosen`` record (an object), else ``ValueError`` naming ``path``, the field and ``fix``."""
    for key in ("tokens_per_s", "mean_accepted_tokens"):
        value = data[key]
        if value is not None and (not _number(value) or value <= 0):
            raise ValueError(f"{path}: {key} = {value!r} must be a finite number > 0 or null; {fix}")
    if not isinstance(data["chosen"], dict):
        raise ValueError(f"{path}: chosen must be an object (how it was chosen), got "
                         f"{str(data['chosen'])[:80]}; {fix}")


def check_dynamic_tree(data: Any, path: Path, head_vocab: int | None) -> dict[str, Any]:
    """Check ``dynamic_tree.json`` and return it: an object whose ``depth``, ``topk`` and ``total`` make a valid
    :class:`~medusa_train.tree.dynamic.DynamicTree` with ``topk`` at most ``head_vocab`` (the drafter's vocabulary;
    unchecked when None), ``tokens_per_s`` and ``mean_accepted_tokens`` finite numbers > 0 or null, and ``chosen``
    an object (its ``static_faster``, when present, a bool).

    Raises:
        ValueError: the file and the field named.
    """
    from medusa_train.tree.dynamic import DynamicTree

    fix = "run medusa-tune-tree again to rewrite it"
    _check_object(data, path, fix)
    missing = [k for k in ("depth", "topk", "total", "tokens_per_s", "mean_accepted_tokens", "chosen")
               if k not in data]
    if missing:
        raise ValueError(f"{path} has no {missing}; {fix}")
    try:
        DynamicTree(data["depth"], data["topk"], data["total"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}; {fix}") from e
    if head_vocab is not None and data["topk"] > head_vocab:
        raise ValueError(f"{path}: dynamic_tree.topk = {data['topk']} exceeds the drafter's vocabulary of "
                         f"{head_vocab}; {fix}")
    _check_timed(data, path, fix)
    if not isinstance(data["chosen"].get("static_faster", False), bool):
        raise ValueError(f"{path}: chosen.static_faster must be true or false (the static tree decoded faster "
                         f"beyond the noise), got {data['chosen']['static_faster']!r}; {fix}")
    return data


def check_composite_tree(data: Any, path: Path, num_heads: int | None, head_vocab: int | None) -> dict[str, Any]:
    """Check ``composite_tree.json`` and return it: an object whose split makes a valid
    :class:`~medusa_train.tree.composite.CompositeTree`, whose ``medusa_choices`` is a valid tree for the heads
    (:func:`check_medusa_choices`), with ``tokens_per_s``, ``mean_accepted_tokens`` and ``chosen`` as
    ``dynamic_tree.json``'s.

    Raises:
        ValueError: the file and the field named.
    """
    from medusa_train.tree.composite import KEYS, CompositeTree

    fix = "run medusa-tune-tree again to rewrite it"
    _check_object(data, path, fix)
    missing = [k for k in (*KEYS, "medusa_choices", "tokens_per_s", "mean_accepted_tokens", "chosen")
               if k not in data]
    if missing:
        raise ValueError(f"{path} has no {missing}; {fix}")
    try:
        CompositeTree(**{key: data[key] for key in KEYS})
    except ValueError as e:
        raise ValueError(f"{path}: {e}; {fix}") from e
    check_medusa_choices(data["medusa_choices"], path, num_heads, head_vocab)
    _check_timed(data, path, fix)
    return data


def read_tree_files(export_dir: str | Path, num_heads: int | None = None,
                    head_vocab: int | None = None) -> dict[str, Any]:
    """The tuned files of an export that exist, checked: ``{"medusa_choices": [[int]], "head_accuracy": {...},
    "latency_profile": {...}, "dynamic_tree": {...}, "composite_tree": {...}}`` (keys of :data:`TREE_FILES`; a missing
    file is a missing key), each as written.

    Args:
        export_dir: the export folder.
        num_heads: the heads' count K, when known: no path deeper, ``acc`` has K rows.
        head_vocab: the heads' output vocabulary, when known: every rank below it.

    Raises:
        ValueError: a file that is not UTF-8, not valid JSON, or not of its shape (the file and the field named;
            :func:`check_medusa_choices`, :func:`check_head_accuracy`, :func:`check_latency_profile`,
            :func:`check_dynamic_tree`, :func:`check_composite_tree`).
    """
    out: dict[str, Any] = {}
    for key, name in TREE_FILES.items():
        path = Path(export_dir) / name
        if path.is_file():
            out[key] = _read_json(path)
    if "medusa_choices" in out:
        check_medusa_choices(out["medusa_choices"], Path(export_dir) / CHOICES_FILE, num_heads, head_vocab)
    if "head_accuracy" in out:
        check_head_accuracy(out["head_accuracy"], Path(export_dir) / ACCURACY_FILE, num_heads)
    if "latency_profile" in out:
        check_latency_profile(out["latency_profile"], Path(export_dir) / LATENCY_FILE)
    if "dynamic_tree" in out:
        check_dynamic_tree(out["dynamic_tree"], Path(export_dir) / DYNAMIC_TREE_FILE, head_vocab)
    if "composite_tree" in out:
        check_composite_tree(out["composite_tree"], Path(export_dir) / COMPOSITE_FILE, num_heads, head_vocab)
    return out


def read_latency_profile(export_dir: str | Path) -> dict[str, Any]:
    """The verification latency profile another tuning run wrote into ``export_dir`` (``latency_from=``), with
    ``latency_ms`` keyed by int tree size.

    Raises:
        FileNotFoundError: no profile there.
        ValueError: not UTF-8, not valid JSON, or not a profile (:func:`check_latency_profile`).
    """
    path = Path(export_dir) / LATENCY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"latency_from={export_dir}: {path} not found; tune that export first")
    try:
        raw = check_latency_profile(_read_json(path), path)
    except ValueError as e:
        raise ValueError(f"latency_from={export_dir}: {e}") from e
    profile = {k: raw[k] for k in ("device", "dtype", "context_length", "repeats", "cpu_kernels") if k in raw}
    return {**profile, "latency_ms": raw["latency_ms"]}


__all__ = ["ACCURACY_FILE", "CHOICES_FILE", "DYNAMIC_TREE_FILE", "LATENCY_FILE", "TREE_FILES", "check_dynamic_tree",
           "check_head_accuracy", "check_latency_profile", "check_medusa_choices", "read_latency_profile",
           "read_tree_files"]
