"""The output folder of one training run: its layout, and the guards that keep one run per folder, intact.

Layout of ``output_dir``::

    train.lock               held by the live run (pid, host, start time, command), see run_lock.py
    train_config.yaml        the run's record: the resolved config of the run that owns the folder
    checkpoints/checkpoint-N the Trainer's checkpoints (complete ones hold a marker, see checkpoints.py)
    self_distill/            regenerated conversations (JSONL, one file per block of 256), reused on resume
    hidden_cache/            cached base hidden states (hidden_cache=true; sealed blocks of 256 rows)
    hydra/                   Hydra's run folder (one log per rank)
    stage1/                  Medusa-2's first stage, a run folder of its own
    export/                  the exported heads and train_head_accuracy.json
    .overwritten/            an overwritten run (its checkpoints/, export/, train_config.yaml), kept until this run
                             has a complete checkpoint or its export (see "Overwriting" below)
    .overwritten.moving/     run entries on their way between the folder and .overwritten/ (always moved back)
    .overwritten.deleting/   run entries to delete (an overwritten run once the new one has a checkpoint)

What is ours: ``checkpoints/`` and ``export/`` belong to a run only when the folder's ``train_config.yaml`` is a
run record (:func:`run_record`: a YAML mapping with the config groups and ``output_dir``, :data:`RECORD_KEYS`; every
run writes it before its first checkpoint or export). A folder holding either with no such record (a project's own
``checkpoints/best_model.ckpt`` or ``export/model.onnx``, beside no ``train_config.yaml`` or another tool's) is not a
run's: it is refused, with or without ``resume=true`` or ``overwrite=true``, and nothing in it is written, moved or
deleted. The other entries above, and a ``train_config.yaml`` with no outputs beside it, are written before a run
has outputs (the lock, the record, caches, Hydra's logs, stage 1) and mark a run's folder on their own; a run never
deletes them.

The rules, in the order a run meets them (all before anything in the folder is written, moved or deleted):

1. :func:`check_location`: ``output_dir`` is not empty, not a file, and is new, empty or one of our runs: a folder of
   someone else's files, or one holding ``checkpoints/`` or ``export/`` without our record, is refused even with
   ``overwrite=true`` (it is never written into, nor deleted);
2. :func:`check_output_dir`: a folder holding a run's checkpoints or export needs ``resume=true`` (same run: only
   the keys in :data:`RESUME_MAY_CHANGE` may differ) or ``overwrite=true``;
3. the main process takes the folder's lock (:class:`~medusa_train.runs.run_lock.RunLock`), settles what a
   killed overwrite left (:func:`settle_overwritten`, below) and checks rule 2 again under it;
4. :func:`prepare_output_dir`, once the model and the data are ready: set an overwritten run aside (never deleted
   here), drop incomplete or damaged checkpoints, write ``train_config.yaml``.

Overwriting (``overwrite=true``), so that no failure of the new run, even from a value no check caught, costs the old
one; all under the lock, each step a rename within ``output_dir`` (atomic):

- set aside (:func:`prepare_output_dir`): the old ``checkpoints/``, ``export/`` and then its ``train_config.yaml``
  are moved into ``.overwritten.moving/``, which is then renamed ``.overwritten/``;
- commit (:func:`discard_overwritten`): once the new run has sealed its first complete checkpoint
  (:class:`~medusa_train.training.callbacks.DiscardOverwritten`) or finished its save (its export), ``.overwritten/``
  is renamed ``.overwritten.deleting/`` and deleted;
- restore (:func:`settle_overwritten`): a run that fails before its commit (any exception, Ctrl-C) moves the new
  run's ``checkpoints/``, ``export/`` and ``train_config.yaml`` into ``.overwritten.deleting/``, renames
  ``.overwritten/`` to ``.overwritten.moving/``, moves its entries back (the record first) and deletes the new run's.
  The folder is then the old run again, file for file; the new run's caches stay (keyed by their content).

A run killed (``kill -9``, power loss) at any point leaves these folders behind. The next run in the folder settles
them right after taking the lock, before its checks, the same way: ``.overwritten.deleting/`` is deleted (the new
run had committed, or its entries were being discarded), ``.overwritten/`` is restored (the new run never committed),
``.overwritten.moving/`` is moved back. So the folder always holds either the old run or the new one that reached a
checkpoint, and ``resume=true`` or ``overwrite=true`` work on it as on any run folder. (Under a launcher the other
ranks check the folder as they find it, read-only, possibly before the main process settled it: at worst they refuse
a run the main process would start, never the reverse.) Medusa-2's ``stage1/`` is overwritten by the same rules, as
the run folder of its own stage: its new stage 1 has committed before the joint stage sets the old joint run aside.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from medusa_train.files.atomic import atomic_write_text
from medusa_train.files.paths import resolve_path
from medusa_train.config.renames import renamed_config
from medusa_train.training import checkpoints
from medusa_train.runs.run_lock import LOCK_FILE

log = logging.getLogger(__name__)

RUN_CONFIG = "train_config.yaml"
# The top-level keys every run record holds (the config groups and output_dir; see "What is ours").
RECORD_KEYS = ("model", "heads", "data", "trainer", "output_dir")
# A run's outputs (only beside our record), and what overwrite=true replaces: the outputs, then the record (set aside
# in this order, restored record first).
OUTPUTS = ("checkpoints", "export")
OVERWRITTEN = (*OUTPUTS, RUN_CONFIG)
ASIDE, MOVING, DELETING = ".overwritten", ".overwritten.moving", ".overwritten.deleting"
# Keys that may differ between the runs sharing a folder: how to start and where the folder is (it may have been
# moved), not what to train.
_NOT_COMPARED = ("resume", "overwrite", "output_dir")
# What one of our run folders holds (any of them marks the folder as a run's).
RUN_ENTRIES = frozenset({RUN_CONFIG, LOCK_FILE, "checkpoints", "export", "self_distill", "hidden_cache", "hydra",
                         "hydra-multirun", "stage1", ASIDE, MOVING, DELETING})
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

    @property
    def aside(self) -> Path:
        return self.root / ASIDE

    @property
    def moving(self) -> Path:
        return self.root / MOVING

    @property
    def deleting(self) -> Path:
        return self.root / DELETING


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


def run_record(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The resolved config recorded in ``root/train_config.yaml`` when it is a run record of ours (a YAML mapping
    holding every key of :data:`RECORD_KEYS`), under today's names (:func:`~medusa_train.config.renames.renamed_config`),
    else None (no such file, unreadable, not YAML, or another tool's)."""
    path = Path(root) / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):
        return None
    if not isinstance(saved, dict) or not all(key in saved for key in RECORD_KEYS):
        return None
    return renamed_config(saved)  # a run recorded under old names resumes as it is


def _found(root: Path, name: str) -> str:
    """``name`` as found in ``root``, with a few of the files under it: ``export/ (model.onnx)``."""
    path = root / name
    if not path.is_dir():
        return name
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"{name}/ ({shown or 'empty'})"


def check_ours(root: Path) -> None:
    """"What is ours" in the module docstring: ``checkpoints/`` or ``export/`` in ``root`` (an existing folder) only
    beside our run record (read-only).

    Raises:
        OutputDirError: either of them without a record of ours; the message names the folder, what was found and
            the fix (another ``output_dir``).
    """
    if not any((root / name).exists() for name in OUTPUTS) or run_record(root) is not None:
        return
    found = [name for name in OVERWRITTEN if (root / name).exists()]
    config = (root / RUN_CONFIG).exists()
    record = (f"its {RUN_CONFIG} is not a medusa-train run record (a mapping with {', '.join(RECORD_KEYS)})"
              if config else f"there is no {RUN_CONFIG}, the record every medusa-train run writes first")
    raise OutputDirError(
        f"output_dir {root} holds {', '.join(_found(root, name) for name in found)} but {record}: these are not a "
        "medusa-train run's, and medusa-train never writes into, moves or deletes them, even with overwrite=true or "
        "resume=true; choose another output_dir (e.g. a new folder inside this one)")


def check_location(output_dir: str | os.PathLike[str]) -> Path:
    """Rule 1 of the module docstring (read-only): ``output_dir`` can hold a run. Returns it, resolved.

    Raises:
        OutputDirError: empty, a file (or under one), on a symlink loop (the links named), not writable, an existing
            folder with entries none of which is one of :data:`RUN_ENTRIES` (the message lists some of them), or one
            holding ``checkpoints/`` or ``export/`` without our run record (:func:`check_ours`).
    """
    text = os.fspath(output_dir)
    if not str(text).strip():
        raise OutputDirError("output_dir is empty: give the folder of this run, e.g. output_dir=runs/stories")
    root = resolve_path(text, "output_dir", OutputDirError)
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
        check_ours(root)
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
            message lists the differences and only the ways out that work; or the folder holds checkpoints or an
            export without our run record (:func:`check_ours`, whatever ``resume`` and ``overwrite`` say).
    """
    has_outputs = bool(checkpoints.list_checkpoints(paths.checkpoints)) or paths.export.is_dir()
    if overwrite or not has_outputs:
        return
    start_over = f"a new output_dir, or overwrite=true to start over in {paths.root} (its checkpoints and export " \
                 "are deleted once the new run has its first checkpoint)"
    saved = run_record(paths.root)
    if saved is None:
        check_ours(paths.root)  # outputs without our record are not a run's (rule 1): always raises here
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
    with ``overwrite`` set the old run aside (:func:`set_aside`), drop incomplete checkpoints (and, before a resume,
    damaged ones: checksums of the newest), save the resolved config (atomically). Nothing of a run is deleted here.
    """
    paths.root.mkdir(parents=True, exist_ok=True)
    if overwrite:
        set_aside(paths)
    checkpoints.remove_incomplete(paths.checkpoints, verify_latest=resume)
    atomic_write_text(paths.config, OmegaConf.to_yaml(OmegaConf.create(resolved)))


def _move(names: tuple[str, ...], source: Path, target: Path) -> None:
    """Rename each of ``names`` present in ``source`` into ``target`` (created), one atomic rename each.

    Raises:
        OutputDirError: ``target`` already holds one of them (the folder is not in a state a run leaves; both named).
    """
    target.mkdir(exist_ok=True)
    for name in names:
        if not os.path.lexists(source / name):
            continue
        if os.path.lexists(target / name):
            raise OutputDirError(f"cannot move {source / name} to {target / name}: both exist, which no run leaves; "
                                 "keep the one you want (a run's train_config.yaml says which run it is), move the "
                                 "other out of the run folder and start again")
        os.rename(source / name, target / name)


def set_aside(paths: RunPaths) -> bool:
    """``overwrite=true`` (main process, holding the lock): move the old run's ``checkpoints/``, ``export/`` and
    then its ``train_config.yaml`` into ``.overwritten/`` (through ``.overwritten.moving/``, see the module
    docstring), a leftover of a killed run settled first. Returns whether there was a run to set aside (one with
    ``checkpoints/`` or ``export/``; a bare record is simply rewritten).

    Raises:
        OutputDirError: ``checkpoints/`` or ``export/`` without our run record (:func:`check_ours`); nothing moved.
    """
    settle_overwritten(paths)
    if not (paths.checkpoints.exists() or paths.export.exists()):
        return False
    check_ours(paths.root)  # what is set aside is deleted later: ours only, also when called without rule 1
    _move(OVERWRITTEN, paths.root, paths.moving)
    os.rename(paths.moving, paths.aside)
    log.info("overwrite=true: the old run is kept in %s until this run has its first checkpoint", paths.aside)
    return True


def _delete(folder: Path) -> None:
    """Delete ``folder`` (a name :func:`discard_overwritten` or :func:`settle_overwritten` gave it)."""
    if folder.exists():
        shutil.rmtree(folder)


def discard_overwritten(paths: RunPaths) -> bool:
    """The commit of ``overwrite=true`` (main process, holding the lock): the run set aside in ``.overwritten/`` is
    renamed ``.overwritten.deleting/`` (atomically: from here on the folder is the new run's) and deleted. Call it
    only once the new run has a complete checkpoint or its export. Returns whether there was one."""
    if not paths.aside.exists():
        return False
    _delete(paths.deleting)
    os.rename(paths.aside, paths.deleting)
    _delete(paths.deleting)
    log.info("overwrite=true: this run has its first checkpoint or export; deleted the run it overwrote in %s",
             paths.root)
    return True


def settle_overwritten(paths: RunPaths) -> bool:
    """Finish what an overwrite left (main process, holding the lock; see the module docstring): delete
    ``.overwritten.deleting/``; restore ``.overwritten/`` (the new run's ``checkpoints/``, ``export/`` and
    ``train_config.yaml`` deleted); move ``.overwritten.moving/`` back. Called after taking the lock (leftovers of a
    killed run) and when a run ends without its commit. Returns whether an old run was restored.

    Raises:
        OutputDirError: an entry to move back exists in the folder too (see :func:`_move`); nothing else changes.
        OSError: a rename or deletion failed (the folder stays in a state the next run settles).
    """
    _delete(paths.deleting)
    restored = paths.aside.exists() or paths.moving.exists()
    if paths.aside.exists():
        _move(OVERWRITTEN, paths.root, paths.deleting)  # the new run's, which never reached a checkpoint
        os.rename(paths.aside, paths.moving)
        _delete(paths.deleting)
    if paths.moving.exists():
        _move(OVERWRITTEN[::-1], paths.moving, paths.root)  # the record first: outputs never lie beside no record
        paths.moving.rmdir()
        log.warning("restored the run in %s that overwrite=true had set aside: the run that overwrote it ended "
                    "before its first checkpoint", paths.root)
    return restored
