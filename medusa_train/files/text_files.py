"""The one reader of the UTF-8 text files medusa-train takes from users (prompt files, ``medusa_choices.json``, an
export's JSON files, self-distilled records, conversation files).

A file that is not UTF-8 raises ``ValueError`` naming the file, the line and the byte where decoding failed (and the
byte itself), instead of Python's bare ``UnicodeDecodeError``, which names neither the file nor the line.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

_CHUNK = 1 << 20


def not_utf8(path: str | Path, data: bytes | None = None) -> ValueError:
    """The error for a file that is not UTF-8: ``{path}:{line}: not UTF-8 text: byte 0x.. at byte offset N (column
    C of that line) ...`` with the fix.

    Args:
        path: the file.
        data: its bytes when already read (else the file is scanned in 1 MiB chunks up to the bad byte).
    """
    offset, line, column, bad = _first_bad_byte(Path(path), data)
    if offset is None:  # the caller's decoder failed where ours does not: report without a position
        return ValueError(f"{path}: not UTF-8 text; save the file as UTF-8")
    return ValueError(f"{path}:{line}: not UTF-8 text: byte 0x{bad:02x} at byte offset {offset} (byte {column} of "
                      f"line {line}) does not decode; save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")


def _chunks(path: Path, data: bytes | None) -> Iterator[bytes]:
    if data is not None:
        yield data
        return
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def _first_bad_byte(path: Path, data: bytes | None) -> tuple[int | None, int, int, int]:
    """(byte offset, 1-based line, 1-based byte column, the byte) of the first byte that does not decode, or
    ``(None, 0, 0, 0)`` when all of it decodes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    start = 0  # byte offset of the current chunk in the file
    line, line_start = 1, 0
    for chunk in [*_chunks(path, data), b""]:
        try:
            decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            # e.object: the bytes the decoder held back from the last chunk (a cut character, no newline), then
            # this chunk; e.start counts from its beginning
            first = start - (len(e.object) - len(chunk))
            before = e.object[: e.start]
            if b"\n" in before:
                line += before.count(b"\n")
                line_start = first + before.rfind(b"\n") + 1
            offset = first + e.start
            return offset, line, offset - line_start + 1, e.object[e.start]
        if b"\n" in chunk:
            line += chunk.count(b"\n")
            line_start = start + chunk.rfind(b"\n") + 1
        start += len(chunk)
    return None, 0, 0, 0


def read_text(path: str | Path) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        FileNotFoundError, OSError: as ``open``.
        ValueError: not UTF-8 (:func:`not_utf8`: the file, line and byte named).
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise not_utf8(path, data) from None


__all__ = ["not_utf8", "read_text"]
