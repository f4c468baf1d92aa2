"""The shipped config-group files (``conf/heads/*.yaml``, ``conf/trainer/*.yaml``) as checked dataclasses, so a
plan made outside a run (``benchmarks/memory_plan.py``) plans with the settings ``medusa-train`` would use."""

from __future__ import annotations

from typing import Any

from medusa_train.config.schema import HeadsConfig, TrainerConfig, as_dataclass
from medusa_train.files.paths import CONF_DIR


def group_file(group: str, name: str) -> Any:
    """``conf/<group>/<name>.yaml`` as a config node without its ``defaults`` list (each file extends its group's
    schema, merged by :func:`preset`).

    Raises:
        ValueError: no such file (the group's files named).
    """
    from omegaconf import OmegaConf

    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"{group}={name}: no such preset; the shipped ones are {', '.join(known)}")
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    return node


def heads_preset(name: str, **overrides: Any) -> HeadsConfig:
    """The :class:`HeadsConfig` of ``heads=<name>`` with ``overrides`` (``heads.<field>``), validated."""
    from omegaconf import OmegaConf

    return as_dataclass(HeadsConfig, OmegaConf.merge(group_file("heads", name), overrides))


def trainer_preset(name: str, **overrides: Any) -> TrainerConfig:
    """The :class:`TrainerConfig` of ``trainer=<name>`` with ``overrides`` (``trainer.<field>``), validated."""
    from omegaconf import OmegaConf

    return as_dataclass(TrainerConfig, OmegaConf.merge(group_file("trainer", name), overrides))


__all__ = ["group_file", "heads_preset", "trainer_preset"]
