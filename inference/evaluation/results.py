"""``results.jsonl``: one row per (prompt, turn, decoder), appended as soon as it is measured, so a run that dies
resumes where it stopped.

A row::

    {"prompt_id": str, "category": str, "turn": int (1-based), "decoder": str, "prompt_tokens": int,
     "new_tokens": int, "wall_time_s": float, "prefill_time_s": float, "forward_passes": int,
     "accepted_lengths": [int], "mean_accepted_tokens": float | null, "tokens_per_second": float,
     "stop_reason": str, "tokens": [int], "text": str, "measured_with": str, "draft_time_s": float | null,
     "verify_time_s": float | null}

plus ``"top2_gaps": [float]`` on the rows of a decoder that records them (vanilla: each token's top-2 logit gap).

``forward_passes`` and ``accepted_lengths`` follow :mod:`inference.decoders.base`'s convention (prefill apart);
``draft_time_s`` and ``verify_time_s`` are the tree decoders' drafting and verification seconds (null for others).
``measured_with`` is the fingerprint of what the decoder measured with (:mod:`inference.evaluation.provenance`;
``run.json`` describes it). Rows superseded by a rerun with another tree, other heads or settings are moved to
``results_superseded.jsonl`` with a ``superseded_because`` field, never deleted.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from inference.decoders.base import DecodeResult
from medusa_train.files.atomic import atomic_write

log = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
SUPERSEDED_FILE = "results_superseded.jsonl"
Key = tuple[str, int, str]  # (prompt_id, turn, decoder)


def row_key(row: dict[str, Any]) -> Key:
    return (str(row["prompt_id"]), int(row["turn"]), str(row["decoder"]))


def make_row(prompt_id: str, category: str, turn: int, decoder: str, result: DecodeResult, text: str,
             measured_with: str | None = None) -> dict:
    """The results.jsonl row of one reply (``measured_with``: the decoder's fingerprint)."""
    tau = result.mean_accepted_tokens
    return {
        "prompt_id": prompt_id, "category": category, "turn": turn, "decoder": decoder,
        "prompt_tokens": result.prompt_tokens, "new_tokens": result.new_tokens,
        "wall_time_s": result.wall_time_s, "prefill_time_s": result.prefill_time_s,
        "forward_passes": result.forward_passes, "accepted_lengths": list(result.accepted_lengths),
        "mean_accepted_tokens": None if math.isnan(tau) else tau, "tokens_per_second": result.tokens_per_second,
        "stop_reason": result.stop_reason, "tokens": list(result.tokens), "text": text,
        "measured_with": measured_with,
        **({"top2_gaps": list(result.top2_gaps)} if result.top2_gaps is not None else {}),
        "draft_time_s": result.draft_time_s, "verify_time_s": result.verify_time_s,
    }


def row_result(row: dict[str, Any]) -> DecodeResult:
    """A row back as a :class:`DecodeResult` (for the aggregation helpers of :mod:`inference.decoders.base`)."""
    return DecodeResult(tokens=list(row["tokens"]), accepted_lengths=list(row["accepted_lengths"]),
                        forward_passes=int(row["forward_passes"]), wall_time_s=float(row["wall_time_s"]),
                        prefill_time_s=float(row["prefill_time_s"]), stop_reason=str(row["stop_reason"]),
                        prompt_tokens=int(row["prompt_tokens"]), text=row.get("text"),
                        draft_time_s=row.get("draft_time_s"), verify_time_s=row.get("verify_time_s"))


def read_rows(path: str | Path, repair: bool = False) -> list[dict[str, Any]]:
    """The rows of a results.jsonl.

    A last line cut short (no final newline: the process died while writing it) is dropped, and with ``repair``
    removed from the file so that appending continues cleanly.

    Raises:
        ValueError: a damaged line elsewhere (its 1-based line number named) or a row without its key fields.
    """
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_text(encoding="utf-8")
    lines = data.split("\n")
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row_key(row)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if lineno == len(lines):  # the unterminated last line of a killed run
                log.warning("%s: dropping the incomplete last line %d (the run was interrupted while writing it)",
                            path, lineno)
                if repair:
                    with open(path, "r+b") as f:
                        f.truncate(len(data[: len(data) - len(line)].encode("utf-8")))
                break
            raise ValueError(f"{path}:{lineno}: not a results row ({e}); delete the file or pass overwrite=true") \
                from e
        rows.append(row)
    else:
        if repair and data and not data.endswith("\n"):  # a complete last row without its newline
            with open(path, "a", encoding="utf-8") as f:
                f.write("\n")
    return rows


class ResultsLog:
    """The rows of a run, loaded from ``results.jsonl`` and appended to it (flushed and synced row by row).

    Args:
        path: the results.jsonl file (created on the first append).

    Raises:
        ValueError: a damaged file or a (prompt, turn, decoder) row given twice.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.rows: dict[Key, dict[str, Any]] = {}
        for row in read_rows(self.path, repair=True):
            key = row_key(row)
            if key in self.rows:
                raise ValueError(f"{self.path} holds two rows for prompt {key[0]} turn {key[1]} decoder {key[2]}")
            self.rows[key] = row

    def __contains__(self, key: Key) -> bool:
        return key in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, key: Key) -> dict[str, Any] | None:
        return self.rows.get(key)

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one line and make it durable before returning.

        Raises:
            ValueError: a row with this key exists already.
        """
        key = row_key(row)
        if key in self.rows:
            raise ValueError(f"results already hold prompt {key[0]} turn {key[1]} decoder {key[2]}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows[key] = row

    def supersede(self, keys: list[Key], reasons: dict[str, str]) -> int:
        """Move the rows ``keys`` to ``results_superseded.jsonl`` (appended, each with ``superseded_because`` from
        ``reasons[decoder]``), then rewrite ``results.jsonl`` without them atomically. Returns how many moved.

        A process killed between the two steps leaves the rows in both files; the rerun moves them again.
        """
        moved = [self.rows[k] for k in keys if k in self.rows]
        if not moved:
            return 0
        with open(self.path.with_name(SUPERSEDED_FILE), "a", encoding="utf-8") as f:
            for row in moved:
                f.write(json.dumps({**row, "superseded_because": reasons.get(row["decoder"], "")},
                                   ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for key in keys:
            self.rows.pop(key, None)
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows.values())
        atomic_write(self.path, lambda p: p.write_text(text, encoding="utf-8"))
        return len(moved)
