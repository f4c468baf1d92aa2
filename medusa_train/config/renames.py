"""Renamed names: what a user types under an old name keeps working in this release, with a ``FutureWarning``.

One rule for every name a user types (README, "Renamed names"): a config key, a config value or a decoder name
that was renamed (the generic parts got generic names: ``docs/architecture.md``) still works on the command line,
with a ``FutureWarning`` naming the new one; the old name goes in a later release. A run folder written under the old
names (its ``train_config.yaml``) resumes as it is. Python imports follow the new module and class names.

- keys (:data:`RENAMED_KEYS`): ``heads.medusa_num_heads`` -> ``heads.num_heads``, ``heads.medusa_num_layers`` ->
  ``heads.num_layers`` (any drafter's count of heads or training-time-test steps; the Medusa export's
  ``config.json`` keeps FasterDecoding's ``medusa_num_heads``);
- values (:data:`RENAMED_VALUES`): ``heads.mode=medusa1`` -> ``frozen_base``, ``medusa2`` -> ``joint`` (the
  presets keep their names: ``heads=medusa1``, ``heads=medusa2``);
- decoder names (:data:`RENAMED_DECODERS`): ``medusa`` -> ``tree`` (the tree decoder runs every drafter type). The
  old name runs the same decoder under its own name, so its rows, its settings (``decoder.medusa.*``) and a run
  folder measured under it stay as they were.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Mapping
from typing import Any

RENAMED_KEYS = {"heads.medusa_num_heads": "heads.num_heads", "heads.medusa_num_layers": "heads.num_layers"}
RENAMED_VALUES = {"heads.mode": {"medusa1": "frozen_base", "medusa2": "joint"}}
RENAMED_DECODERS = {"medusa": "tree"}

# a command-line override: an optional +, ++ or ~, the dotted key, then = and the value (or nothing, for ~)
_OVERRIDE = re.compile(r"^(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w.]*)(?P<rest>(=.*)?)$", re.S)


def warn_renamed(kind: str, old: str, new: str) -> None:
    """Warn (``FutureWarning``) that ``old``, a ``kind`` (``key``, ``value``, ``decoder``), is now ``new``."""
    warnings.warn(f"{kind} {old} is now {new}: {old} keeps working in this release and goes in a later one "
                  "(README: Renamed names)", FutureWarning, stacklevel=3)


def _renamed_value(key: str, value: str) -> str:
    """``value`` of ``key`` (one value or a sweep's comma-separated list) with old values renamed, warned."""
    renamed = RENAMED_VALUES.get(key)
    if not renamed:
        return value
    parts = value.split(",")
    for i, part in enumerate(parts):
        if part.strip() in renamed:
            new = renamed[part.strip()]
            warn_renamed("value", f"{key}={part.strip()}", f"{key}={new}")
            parts[i] = part.replace(part.strip(), new)
    return ",".join(parts)


def renamed_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with the old keys and values replaced by the new ones, each warned once; anything
    else (flags, other keys, decoder names) is returned unchanged."""
    out = []
    for arg in overrides:
        match = _OVERRIDE.match(arg)
        if match is None:
            out.append(arg)
            continue
        prefix, key, rest = match.group("prefix") or "", match.group("key"), match.group("rest")
        if key in RENAMED_KEYS:
            warn_renamed("key", key, RENAMED_KEYS[key])
            key = RENAMED_KEYS[key]
        if rest.startswith("="):
            rest = "=" + _renamed_value(key, rest[1:])
        out.append(f"{prefix}{key}{rest}")
    return out


def renamed_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved config (nested mappings, e.g. an old run's ``train_config.yaml``) under the new keys and values,
    silently: the user typed none of it. A key present under both names keeps the new one."""
    out = copy.deepcopy(dict(config))
    for old, new in RENAMED_KEYS.items():
        *path, old_leaf = old.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and old_leaf in node:
            value = node.pop(old_leaf)
            node.setdefault(new.rsplit(".", 1)[1], value)
    for key, renamed in RENAMED_VALUES.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf] in renamed:
            node[leaf] = renamed[node[leaf]]
    return out


def decoder_alias(name: str) -> str | None:
    """The new name of ``name`` when it is a renamed decoder (warned), else None."""
    new = RENAMED_DECODERS.get(name)
    if new is not None:
        warn_renamed("decoder", name, new)
    return new


__all__ = ["RENAMED_DECODERS", "RENAMED_KEYS", "RENAMED_VALUES", "decoder_alias", "renamed_config",
           "renamed_overrides", "warn_renamed"]
