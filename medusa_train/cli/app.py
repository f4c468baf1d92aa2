"""The Hydra entry points' shared front door: required settings missing from the command line get one line.

Hydra resolves its own settings (``hydra.run.dir: ${output_dir}``, ``${export_dir}/.tune_tree``) before the task
runs, so a missing ``export_dir`` would print about a hundred lines of Hydra internals. :func:`hydra_app` composes
the config first (the same files, schemas and overrides Hydra will use) and, when a required value (``???``) is
still missing, prints one line (``medusa-tune-tree: export_dir is required: add export_dir=... (e.g.
medusa-tune-tree export_dir=runs/stories/export)``) and exits with status 2, before Hydra creates any folder. So does
a model preset naming a model that is not installed yet (``${medusa.installed_model:...}``): the line names the model
and its install command.
Anything else (bad keys, sweeps, ``--help``, ``--cfg``) is left to Hydra's own messages.

Nothing is registered on import: each entry point passes its ``register_schemas`` to :func:`hydra_app`, which calls
it before anything composes (the required-settings check, then ``@hydra.main``). Tests and benchmarks that compose
``conf/`` themselves call the same function first.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from medusa_train.config.schema import register_configs
from medusa_train.files.paths import CONF_DIR
from medusa_train.config.renames import renamed_overrides
from medusa_train.cli.resolvers import register_resolvers


HYDRA_NODE = "hydra"  # the Hydra framework's own node of a composed config (not the Hydra drafter)


class RefuseBeforeRun(Callback):
    """Hydra callback: check one setting before Hydra creates or writes the job's folder, and exit with the check's
    one-line message on stderr and status 2 (a refused command line, as a missing required setting) when it fails
    (Hydra turns a callback's exceptions into warnings, so this one exits instead).

    Args (the ``hydra.callbacks`` entry of a ``conf/`` file):
        check: the dotted path of a function taking the setting's value and raising ``ValueError`` or ``OSError``.
        key: the setting, a dotted path into the config (``output_dir``, ``hydra.run.dir``); null: the whole config
            without Hydra's own node (a command's settings, for its schema's ``validate``).
        command: the command's name, put before the message.
        multirun: also check before a ``-m`` sweep starts (the sweep folder).
        pass_hydra_entries: also give the check :func:`hydra_entries` of the run (a folder check then accepts what
            Hydra wrote there for an earlier, killed, run of the same command).
    """

    def __init__(self, check: str, key: str | None, command: str, multirun: bool = False,
                 pass_hydra_entries: bool = False) -> None:
        self.check, self.key, self.command, self.multirun = check, key, command, multirun
        self.pass_hydra_entries = pass_hydra_entries

    def _check(self, config: DictConfig) -> None:
        if self.key is None:
            args = [OmegaConf.masked_copy(config, [key for key in config if key != HYDRA_NODE])]
        else:
            args = [OmegaConf.select(config, self.key)]
        if self.pass_hydra_entries:  # what Hydra writes into the job's folder: an earlier killed job left them
            args.append(hydra_entries(config.hydra))
        try:
            hydra.utils.get_method(self.check)(*args)
        except (ValueError, OSError) as e:
            print(f"{self.command}: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        if self.multirun:
            self._check(config)


def hydra_entries(hydra_cfg: Any) -> set[str]:
    """What Hydra writes into a job's folder before the task starts, given the ``hydra`` node of its config: the
    ``output_subdir`` (``.hydra``, unless null) and the job's log, ``<job name>.log``."""
    return {name for name in (hydra_cfg.output_subdir, f"{hydra_cfg.job.name}.log") if name}


def register_shared_schemas() -> None:
    """What every ``conf/`` file may compose from: the ``${medusa.*}`` resolvers and the shared schemas
    (``schema/model``, ``schema/heads``, ..., ``schema/train``). Idempotent."""
    register_resolvers()
    register_configs()


def missing_required(config_name: str, overrides: list[str], conf_dir: Path = CONF_DIR) -> list[str] | None:
    """Dotted keys still ``???`` once ``<conf_dir>/<config_name>.yaml`` is composed with ``overrides`` (the
    ``hydra`` node left out); None when the command line does not compose as one run (flags other than ``-m``,
    sweeps of several values, errors: Hydra reports those itself)."""
    cfg = _composed(config_name, overrides, conf_dir)
    return None if cfg is None else _missing_outside_hydra(cfg)


def _missing_outside_hydra(cfg: DictConfig) -> list[str]:
    return [key for key in _missing(cfg, "") if not key.startswith("hydra.")]


def _composed(config_name: str, overrides: list[str], conf_dir: Path = CONF_DIR) -> DictConfig | None:
    """``<conf_dir>/<config_name>.yaml`` composed with ``overrides`` as Hydra will (interpolations unresolved); None
    when the command line does not compose as one run (see :func:`missing_required`)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [arg for arg in overrides if arg not in ("-m", "--multirun")]  # a sweep composes per value below
    if any(arg.startswith("-") for arg in overrides):
        return None
    try:
        with initialize_config_dir(str(conf_dir), version_base="1.3"):
            return compose(config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException, ValueError):
        return None


def not_installed(node: Any) -> str | None:
    """The message of the first value of a composed config that names a model not installed yet
    (``${medusa.installed_model:KEY}``: :class:`~medusa_train.loading.chunked_gguf.NotInstalledError`), else None.
    Only those values are resolved, outside the ``hydra`` node (which repeats the command line's text)."""
    from omegaconf.errors import InterpolationResolutionError

    from medusa_train.loading.chunked_gguf import NotInstalledError

    for key in node:
        child = node._get_node(key)
        if key == HYDRA_NODE and node._get_parent() is None:
            continue
        if OmegaConf.is_dict(child):
            found = not_installed(child)
            if found:
                return found
        elif child._is_interpolation() and "medusa.installed_model:" in str(child._value()):
            try:
                node[key]
            except InterpolationResolutionError as e:
                cause = resolver_error(e, NotInstalledError)
                if cause is None:
                    raise
                return str(cause)
    return None


def resolver_error(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` in ``error``'s chain, else None: a resolver's own error behind
    OmegaConf's ``InterpolationResolutionError`` (OmegaConf chains its own errors before it, as their context)."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, kind):
        cause = cause.__cause__ or cause.__context__
    return cause


def _missing(node: Any, prefix: str) -> list[str]:
    missing = []
    for key in node:
        path = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            missing.append(path)
        else:
            child = node._get_node(key)
            if OmegaConf.is_dict(child):
                missing += _missing(child, f"{path}.")
    return missing


def kept_searchpath(overrides: list[str], primary: Path) -> list[str]:
    """``overrides`` with a ``hydra.searchpath=[...]`` of the command line extended by the ``primary`` config's own
    ``hydra.searchpath`` entries it lacks: on the command line Hydra replaces the primary's list, which would lose the
    groups found there (``inference``'s configs find ``model/`` at ``pkg://medusa_train.conf``). The user's entries
    come first, so their presets win."""
    own = OmegaConf.select(OmegaConf.load(primary), "hydra.searchpath") or []
    kept = []
    for arg in overrides:
        given = re.fullmatch(r"(\+{0,2}hydra\.searchpath)=\[(.*)\]", arg)
        if given and own:
            entries = [entry.strip() for entry in given.group(2).split(",") if entry.strip()]
            arg = f"{given.group(1)}=[{','.join(entries + [e for e in own if e not in entries])}]"
        kept.append(arg)
    return kept


def hydra_app(config_name: str, example: str, register_schemas: Callable[[], None], conf_dir: Path = CONF_DIR
              ) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """``@hydra.main`` over ``<conf_dir>/<config_name>.yaml``, preceded by the schemas' registration and the
    required-settings check.

    Args:
        config_name: the primary config (``evaluate``, ``tune_tree``, ...).
        example: a complete command line, shown when something required is missing; its first word names the
            command in the message.
        register_schemas: registers the schemas and resolvers the config composes from (idempotent); called once per
            run, before anything composes.
        conf_dir: the folder of the primary config (``medusa_train/conf``; ``inference/conf`` for ``inference``'s
            commands, whose primaries put ``medusa_train/conf`` on their search path).
    """
    def decorate(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        app = hydra.main(config_path=str(conf_dir), config_name=config_name, version_base="1.3")(task)

        @functools.wraps(task)
        def main() -> Any:
            sys.argv[1:] = renamed_overrides(sys.argv[1:])  # old names keep working, warned (medusa_train.config.renames)
            sys.argv[1:] = kept_searchpath(sys.argv[1:], conf_dir / f"{config_name}.yaml")
            register_schemas()
            cfg = _composed(config_name, sys.argv[1:], conf_dir)
            missing = None if cfg is None else _missing_outside_hydra(cfg)
            command = example.split()[0]
            if missing:
                names = " and ".join(", ".join(missing).rsplit(", ", 1))
                verb = "is" if len(missing) == 1 else "are"
                add = " ".join(f"{key}=..." for key in missing)
                print(f"{command}: {names} {verb} required: add {add} (e.g. {example})", file=sys.stderr)
                raise SystemExit(2)
            uninstalled = None if cfg is None else not_installed(cfg)
            if uninstalled:
                print(f"{command}: {uninstalled}", file=sys.stderr)
                raise SystemExit(2)
            return app()

        return main

    return decorate


__all__ = ["hydra_app", "kept_searchpath", "missing_required", "not_installed", "register_shared_schemas",
           "resolver_error"]
