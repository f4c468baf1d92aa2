"""Command-line flags of the argparse scripts (``benchmarks/``): a refusal is one line naming the flag as typed and
the fix, exit status 2, no traceback, before any work.

A script builds a :class:`FlagParser`, states each numeric flag's range once as a :class:`~medusa_train.config.bounds.Bound`
(a flag that sets a config field takes that field's bound: :func:`schema_bound`), and calls :func:`check_flags`
after parsing; errors raised later by the library in terms of config fields are turned into the flags that set them
by :func:`as_flags`. ``tests/test_flags.py`` walks every numeric flag of every such script the way
``test_schema_bounds.py`` walks the config schemas.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from typing import NoReturn

from medusa_train.config.bounds import Bound, field_bound


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE``, on stderr, exit status 2 (argparse's
    own prints the usage first). ``--help`` is unchanged."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def schema_bound(schema: type, name: str) -> Bound:
    """The :class:`~medusa_train.config.bounds.Bound` the config dataclass ``schema`` declares for field ``name``.

    Raises:
        KeyError: the field has none (a flag mirroring it must not go unchecked).
    """
    for f in dataclasses.fields(schema):
        if f.name == name and field_bound(f) is not None:
            return field_bound(f)
    raise KeyError(f"{schema.__name__}.{name} declares no bound")


def flag_of(parser: argparse.ArgumentParser, dest: str) -> str:
    """The flag the user types for ``dest`` (its longest option string, e.g. ``--gpu-gib``)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return dest


def check_flags(parser: FlagParser, args: argparse.Namespace, bounds: Mapping[str, Bound]) -> None:
    """Check each flag of ``bounds`` (``dest -> Bound``) in ``args``; a flag left out (None) passes.

    Raises:
        SystemExit: status 2, after one line naming the flag, its range and the value given (``--gpu-gib must be
            > 0 (memory of one GPU in GiB, e.g. 80), got 0.0``).
    """
    for dest, rule in bounds.items():
        value = getattr(args, dest)
        if value is None:
            continue
        try:
            rule.check(value, flag_of(parser, dest))
        except ValueError as e:
            parser.error(str(e))


def as_flags(message: str, fields: Mapping[str, str]) -> str:
    """``message`` on one line with each config field of ``fields`` (``field -> flag``, e.g. ``heads.head_vocab_size
    -> --head-vocab-size``) named as the flag that sets it: ``field=VALUE`` becomes ``flag VALUE``, a bare ``field``
    the flag."""
    text = one_line(message)
    for field, flag in sorted(fields.items(), key=lambda kv: -len(kv[0])):  # the longest first: no prefix clash
        text = re.sub(rf"(?<![\w.]){re.escape(field)}=", f"{flag} ", text)
        text = re.sub(rf"(?<![\w.]){re.escape(field)}(?![\w.])", flag, text)
    return text


def refuse(parser: FlagParser, message: str, fields: Mapping[str, str] | None = None) -> NoReturn:
    """Exit with status 2 after one line: ``message`` with the fields named as flags (:func:`as_flags`)."""
    parser.error(as_flags(message, fields or {}))


def numeric_flags(parser: argparse.ArgumentParser) -> dict[str, type]:
    """``dest -> int or float`` of every flag that takes one number (what :func:`check_flags` must cover)."""
    return {a.dest: a.type for a in parser._actions if a.type in (int, float) and a.nargs is None}


__all__ = ["FlagParser", "as_flags", "check_flags", "flag_of", "numeric_flags", "one_line", "refuse",
           "schema_bound"]
