"""The output folder of one training run: its layout, and the guards that keep one run per folder, intact.

Layout of ``output_dir``::

    train.lock               held by the live run (pid, host, start time, command), see run_lock.py
    train_config.yaml        the resolved config of the run that owns the folder
    checkpoints/checkpoint-N the Trainer's checkpoints (complete ones hold a marker, see checkpoints.py)
    self_distill/            regenerated conversations (JSONL, one file per rank), reused on resume
    hidden_cache/            cached base hidden states (hidden_cache=true)
    hydra/                   Hydra's run folder (one log per rank)
    stage1/                  Medusa-2's first stage, a run folder of its own
    export/                  the exported heads and train_head_accuracy.json

The rules, in the order a run meets them (all before anything in the folder is written, deleted or rewritten):

1. :func:`check_location`: ``output_dir`` is not empty, not a file, and is new, empty or one of our runs (a folder
   of someone else's files is refused even with ``overwrite=true``: it is never written into, nor deleted);
2. :func:`check_output_dir`: a folder holding a run's checkpoints or export needs ``resume=true`` (same run: only
   the keys in :data:`RESUME_MAY_CHANGE` may differ) or ``overwrite=true``;
3. the main process takes the folder's lock (:class:`~medusa_train.training.run_lock.RunLock`) and checks rule 2
   again under it;
4. :func:`prepare_output_dir`, once the model and the data are ready: clear an overwritten run, drop incomplete or
   damaged checkpoints, write ``train_config.yaml``.
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
from medusa_train.training.run_lock import LOCK_FILE

log = logging.getLogger(__name__)

RUN_CONFIG = "train_config.yaml"
# Keys that may differ between the runs sharing a folder: how to start and where the folder is (it may have been
# moved), not what to train.
_NOT_COMPARED = ("resume", "overwrite", "output_dir")
# What one of our run folders holds (any of them marks the folder as a run's).
RUN_ENTRIES = frozenset({RUN_CONFIG, LOCK_FILE, "checkpoints", "export", "self_distill", "hidden_cache", "hydra",
                         "hydra-multirun", "stage1"})
# Keys (or key prefixes ending in ".") that resume=true may change. Every other key fixes what the checkpoints hold
# (head and base shapes, the optimizer and scheduler state, whose learning rate and betas the Trainer restores over
# the config's) or the data order a resumed run continues (data, seed, max_length, batch and accumulation sizes).
RESUME_MAY_CHANGE = (
    "trainer.max_steps", "trainer.num_train_epochs", "trainer.logging_steps", "trainer.save_steps",
    "trainer.save_total_limit", "trainer.per_device_eval_batch_size", "trainer.dataloader_num_workers",
    "trainer.disable_tqdm", "trainer.max_grad_norm", "trainer.use_cpu", "trainer.ddp_backend",
    "logger.", "export", "export_vllm", "push_to_hub", "hub_repo_id", "hub_private", "hub_revision",
    "data.num_proc", "data.generation_batch_size", "data.self_distill_dir", "hidden_cache", "hidden_cache_dir",
    "model.device", "model.dtype", "model.attn_implementation", "model.cache_converted",
)


class OutputDirError(ValueError):
    """``output_dir`` cannot hold this run (empty, a file, someone else's folder, or another run's)."""


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
    """Dotted keys whose values differ between two resolved configs (``resume``, ``overwrite``, ``output_dir``
    ignored)."""
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(k for k in set(a) | set(b) if k.split(".")[0] not in _NOT_COMPARED and a.get(k) != b.get(k))
    return keys


def resume_may_change(key: str) -> bool:
    """Whether ``resume=true`` may continue a run with another value of ``key`` (see :data:`RESUME_MAY_CHANGE`)."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_MAY_CHANGE)


def _shown(keys: list[str], saved: dict[str, Any], current: dict[str, Any]) -> str:
    a, b = _flatten(saved), _flatten(current)
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    return ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in keys[:8]) + more


def check_location(output_dir: str | os.PathLike[str]) -> Path:
    """Rule 1 of the module docstring (read-only): ``output_dir`` can hold a run. Returns it, resolved.

    Raises:
        OutputDirError: empty, a file (or under one), not writable, or an existing folder with entries none of which
            is one of :data:`RUN_ENTRIES` (the message lists some of them).
    """
    text = os.fspath(output_dir)
    if not str(text).strip():
        raise OutputDirError("output_dir is empty: give the folder of this run, e.g. output_dir=runs/stories")
    root = Path(text).resolve()
    if root.exists() and not root.is_dir():
        raise OutputDirError(f"output_dir {root} is a file, not a folder: choose a folder for the run")
    if root.is_dir():
        entries = sorted(os.listdir(root))
        if entries and not RUN_ENTRIES.intersection(entries):
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise OutputDirError(
                f"output_dir {root} holds files that are not a medusa-train run ({shown}): medusa-train writes "
                "only into a new or empty folder or one of its own runs, and never into or over other files, even "
                "with overwrite=true; choose another output_dir (e.g. a new folder inside this one)")
        writable = root
    else:
        writable = next(p for p in root.parents if p.exists())
        if not writable.is_dir():
            raise OutputDirError(f"output_dir {root} cannot be created: {writable} is a file")
    if not os.access(writable, os.W_OK | os.X_OK):
        raise OutputDirError(f"output_dir {root} cannot be written: {writable} is not writable by this user")
    return root


def check_output_dir(paths: RunPaths, resolved: dict[str, Any], resume: bool, overwrite: bool,
                     world_size: int = 1) -> None:
    """Rule 2 of the module docstring: refuse to start in a folder that holds another run (read-only, every rank).

    A folder "holds a run" once it has checkpoints or an export; a run that stopped before its first checkpoint
    leaves nothing worth protecting (its caches are keyed by their content and reused when they match).

    Raises:
        OutputDirError: the folder holds a run and neither ``resume=true`` nor ``overwrite=true`` is given, or
            ``resume=true`` asks to change what the run's checkpoints fix (anything outside
            :data:`RESUME_MAY_CHANGE`, or the number of ranks, ``world_size``, that wrote the newest checkpoint); the
            message lists the differences and only the ways out that work.
    """
    has_outputs = bool(checkpoints.list_checkpoints(paths.checkpoints)) or paths.export.is_dir()
    if overwrite or not has_outputs:
        return
    start_over = f"a new output_dir, or overwrite=true to start over in {paths.root} (its checkpoints and export " \
                 "are deleted)"
    if not paths.config.is_file():
        if not resume:
            raise OutputDirError(f"output_dir {paths.root} holds checkpoints or an export but no {RUN_CONFIG}; use "
                                 f"{start_over}")
        return
    saved = OmegaConf.to_container(OmegaConf.load(paths.config), resolve=True)
    diff = config_differences(saved, resolved)
    fixed = {k: _shown([k], saved, resolved) for k in diff if not resume_may_change(k)}  # name -> "k (a -> b)"
    saved_ranks = checkpoints.saved_world_size(paths.checkpoints)
    if saved_ranks is not None and saved_ranks != world_size:
        fixed["the number of ranks"] = f"the number of ranks ({saved_ranks} wrote the checkpoints -> {world_size})"
    if resume and fixed:
        raise OutputDirError(
            f"resume=true cannot continue the run in {paths.root} with {', '.join(fixed.values())}: its checkpoints "
            "fix these (tensor shapes, optimizer state, data order). Resume with the run's own values (see "
            f"{paths.config}), or train with the new ones in {start_over}")
    if resume:
        if diff:
            log.warning("resuming in %s with a changed config: %s", paths.root, _shown(diff, saved, resolved))
        return
    resume_works = "resume=true to continue that run with these values" if diff else "resume=true to continue it"
    ways = (f"{resume_works}, {start_over}" if not fixed
            else f"{start_over}; resume=true continues a run only with its own {', '.join(fixed)}")
    if diff:
        raise OutputDirError(f"output_dir {paths.root} holds another run whose config differs in "
                             f"{_shown(diff, saved, resolved)}. Use {ways}")
    raise OutputDirError(f"output_dir {paths.root} already holds checkpoints or an export of this run. Use {ways}")


def prepare_output_dir(paths: RunPaths, resolved: dict[str, Any], overwrite: bool, resume: bool = False) -> None:
    """Rule 4 of the module docstring (main process, holding the lock, once the model and the data are ready):
    clear an overwritten run, drop incomplete checkpoints (and, before a resume, damaged ones: checksums of the
    newest), save the resolved config (atomically)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for folder in (paths.checkpoints, paths.export):
            shutil.rmtree(folder, ignore_errors=True)
    checkpoints.remove_incomplete(paths.checkpoints, verify_latest=resume)
    tmp = paths.root / f".{RUN_CONFIG}.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    os.replace(tmp, paths.config)
