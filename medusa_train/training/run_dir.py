"""The output folder of one training run: its layout, and the guard against mixing two runs in one folder.

Layout of ``output_dir``::

    train_config.yaml        the resolved config of the run that owns the folder
    checkpoints/checkpoint-N the Trainer's checkpoints (complete ones hold a marker, see checkpoints.py)
    self_distill/            regenerated conversations (JSONL, one file per rank), reused on resume
    hidden_cache/            cached base hidden states (hidden_cache=true)
    hydra/                   Hydra's run folder (config and one log per rank)
    export/                  the exported heads and train_head_accuracy.json
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from medusa_train.training import checkpoints

log = logging.getLogger(__name__)

RUN_CONFIG = "train_config.yaml"
# Keys that may differ between the runs sharing a folder: how to start, not what to train.
_NOT_COMPARED = ("resume", "overwrite")


@dataclass(frozen=True)
class RunPaths:
    """Paths inside ``output_dir`` (see the module docstring)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / RUN_CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def self_distill(self) -> Path:
        return self.root / "self_distill"

    @property
    def hidden_cache(self) -> Path:
        return self.root / "hidden_cache"


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two resolved configs (``resume``/``overwrite`` ignored)."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(k for k in set(a) | set(b) if k.split(".")[0] not in _NOT_COMPARED and a.get(k) != b.get(k))
    return keys


def check_output_dir(paths: RunPaths, resolved: dict[str, Any], resume: bool, overwrite: bool) -> None:
    """Refuse to start in a folder that holds another run, before anything expensive (read-only, every rank).

    A folder "holds a run" once it has checkpoints or an export; a run that stopped before its first checkpoint
    leaves nothing worth protecting (its caches are keyed by their content and reused when they match).

    Raises:
        ValueError: the folder holds a run with a different config, or this run's checkpoints/export, and neither
            ``resume=true`` nor ``overwrite=true`` is given; the message lists the differing keys and the ways out.
    """
    has_outputs = bool(checkpoints.list_checkpoints(paths.checkpoints)) or paths.export.is_dir()
    if overwrite or not has_outputs:
        return
    if paths.config.is_file():
        saved = OmegaConf.to_container(OmegaConf.load(paths.config), resolve=True)
        diff = config_differences(saved, resolved)
        if diff and not resume:
            shown = ", ".join(f"{k} ({_flatten(saved).get(k)!r} -> {_flatten(resolved).get(k)!r})" for k in diff[:8])
            more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
            raise ValueError(
                f"output_dir {paths.root} holds another run whose config differs in {shown}{more}. Use resume=true "
                "to continue that run with this config, a new output_dir, or overwrite=true to start over there"
            )
        if diff:
            log.warning("resuming in %s with a changed config: %s", paths.root, ", ".join(diff))
    if not resume:
        raise ValueError(
            f"output_dir {paths.root} already holds checkpoints or an export of this run. Use resume=true to "
            "continue it, a new output_dir, or overwrite=true to start over"
        )


def prepare_output_dir(paths: RunPaths, resolved: dict[str, Any], overwrite: bool) -> None:
    """Main process only, after :func:`check_output_dir`: clear an overwritten run, drop incomplete checkpoints,
    save the resolved config (atomically)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for folder in (paths.checkpoints, paths.export):
            shutil.rmtree(folder, ignore_errors=True)
    checkpoints.remove_incomplete(paths.checkpoints)
    tmp = paths.root / f".{RUN_CONFIG}.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    os.replace(tmp, paths.config)
