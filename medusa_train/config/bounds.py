"""Numeric bounds of the config schemas: stated once, next to each field, and checked by one function.

A schema's int or float field declares its range in its metadata, e.g.
``adam_beta1: float = field(default=0.9, metadata=bound(0, 1, high_open=True))``, and the schema's ``validate()``
calls :func:`check_bounds`, which checks every such field (and those of nested schemas) before anything else runs, so
a value out of range is refused by name (``trainer.adam_beta1 must be in [0, 1), got 1.5``) before any model loads
or any file is touched. ``None`` passes only where the field is ``Optional`` (it then means "off" or "default").

Counts that have no natural upper end still get a hard cap (:data:`MAX_TOKENS`, :data:`MAX_COUNT`, ...): a typo such
as ``max_new_tokens=1e12`` would otherwise run for hours. A field deliberately left without any bound says so with
:func:`unbounded` and its reason.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 1 << 20  # token lengths and counts: above any model's context, far below a typo such as 1e12
MAX_COUNT = 1 << 20  # other counts (prompts, batch rows, repeats, heads, tree nodes, layers)
MAX_STEPS = (1 << 31) - 1  # optimizer steps: torch's and transformers' schedulers count in int32 at most
MAX_EPOCHS = 1e6  # passes over the data
MAX_PROCESSES = 1024  # worker processes (data loading, tokenization)
MAX_TIMEOUT_MINUTES = 7 * 24 * 60  # a collective's timeout: a week
MAX_SEED = (1 << 32) - 1  # numpy's seed range (transformers' set_seed seeds numpy too)

_KEY = "bound"


@dataclass(frozen=True)
class Bound:
    """The range of one numeric field.

    Attributes:
        low, high: the range's ends (None: open-ended on that side).
        low_open, high_open: the end itself is excluded (``(0, 1]``: ``low_open=True``).
        cap: a hard upper limit against typos, for fields whose range has no natural upper end.
        hint: what the field means or what a special value does, quoted in the error.
        unbounded: the reason a field has no bound at all (then every finite value passes).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    cap: float | None = None
    hint: str = ""
    unbounded: str = ""

    def range_text(self) -> str:
        """The range in words: ``in [0, 1)``, ``>= 1``, ``> 0``, ``<= 1``; empty when unbounded."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return ""

    def admits(self, value: Any, optional: bool = False) -> bool:
        """Whether ``value`` passes :meth:`check`."""
        try:
            self.check(value, "value", optional)
        except ValueError:
            return False
        return True

    def check(self, value: Any, name: str, optional: bool = False) -> None:
        """Raise ``ValueError`` naming ``name`` (the dotted field) unless ``value`` is in range.

        Refused: a bool or non-number, NaN and infinities, a value outside ``[low, high]`` (the open ends excluded)
        or above ``cap``; None unless ``optional``.
        """
        null = " or null" if optional else ""
        hint = f" ({self.hint})" if self.hint else ""
        if value is None:
            if optional:
                return
            raise ValueError(f"{name} must be a number, got None")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number{null}, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number{null}{hint}, got {value!r}")
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if below or above:
            raise ValueError(f"{name} must be {self.range_text()}{null}{hint}, got {value!r}")
        if self.cap is not None and value > self.cap:
            raise ValueError(f"{name} must be at most {_num(self.cap)} (a hard cap against typos such as 1e12), "
                             f"got {value!r}")


def bound(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
          cap: float | None = None, hint: str = "") -> dict[str, Bound]:
    """Field metadata stating a numeric range (see :class:`Bound`): ``field(default=..., metadata=bound(1))``."""
    return {_KEY: Bound(low, high, low_open, high_open, cap, hint)}


def unbounded(reason: str) -> dict[str, Bound]:
    """Field metadata for a numeric field deliberately left without a range; ``reason`` says why (non-empty).
    Only NaN and infinities are refused."""
    if not reason:
        raise ValueError("unbounded() needs the reason the field has no range")
    return {_KEY: Bound(unbounded=reason)}


def field_bound(f: dataclasses.Field) -> Bound | None:
    """The :class:`Bound` a dataclass field declares, or None."""
    return f.metadata.get(_KEY)


@functools.cache
def optional_fields(cls: type) -> frozenset[str]:
    """Names of the fields of dataclass ``cls`` whose type admits None (``Optional[...]``)."""
    hints = typing.get_type_hints(cls)
    return frozenset(name for name, hint in hints.items()
                     if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint))


def check_bounds(obj: Any, prefix: str = "", nested: bool = True) -> None:
    """Check every bounded field of the dataclass instance ``obj`` (list fields element by element), and with
    ``nested`` those of the dataclasses it holds, recursively.

    Args:
        obj: a schema instance (e.g. :class:`medusa_train.config.schema.TrainerConfig`).
        prefix: its dotted path in the config (``trainer``), put before each field's name in errors.
        nested: also check the dataclass-valued fields (False where they are checked by their own ``validate``).

    Raises:
        ValueError: the first value out of range, named by its dotted path (``trainer.adam_beta1 must be in
            [0, 1), got 1.5``; ``latency_sizes[2] must be ...``).
    """
    optional = optional_fields(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}.{f.name}" if prefix else f.name
        rule = field_bound(f)
        if rule is not None:
            if isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    rule.check(item, f"{name}[{i}]")
            else:
                rule.check(value, name, f.name in optional)
        elif nested and dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_bounds(value, name)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


__all__ = ["Bound", "MAX_COUNT", "MAX_EPOCHS", "MAX_PROCESSES", "MAX_SEED", "MAX_STEPS", "MAX_TOKENS", "bound",
           "check_bounds", "field_bound", "optional_fields", "unbounded"]
