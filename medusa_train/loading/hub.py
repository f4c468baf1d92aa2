"""Exports from the Hugging Face Hub or a local folder: the one downloader every reader uses.

``HF_ENDPOINT`` is read when a function runs (``huggingface_hub`` reads it once, at import), so a process can
point at a mirror or a local test server after importing transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

from medusa_train.export.tree_files import CHOICES_FILE, DYNAMIC_TREE_FILE
from medusa_train.export.writer import CONFIG_FILE, LEGACY_WEIGHTS_FILE, TOKEN_MAP_FILE, weights_files



def decoder_files() -> list[str]:
    """What a decoder needs from a published export (vllm/ and eval/ are not downloaded for it): config.json, every
    drafter type's weights file (:func:`~medusa_train.export.writer.weights_files`), the token map and the tuned
    trees (static, and dynamic for drafters that grow one). FasterDecoding's .pt (:data:`FASTERDECODING_WEIGHTS`)
    only when a repository has none of these weights files (a FasterDecoding repository of its own)."""
    return [CONFIG_FILE, *weights_files(), TOKEN_MAP_FILE, CHOICES_FILE, DYNAMIC_TREE_FILE]


FASTERDECODING_WEIGHTS = LEGACY_WEIGHTS_FILE


def hub_endpoint(endpoint: str | None = None) -> str | None:
    """``endpoint``, else ``$HF_ENDPOINT`` now, else None (huggingface_hub's default)."""
    value = endpoint or os.environ.get("HF_ENDPOINT") or None
    return value.rstrip("/") if value else None


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id (``name`` or ``namespace/name``) rather than a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or "\\" in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download_export(
    repo_id_or_path: str | os.PathLike[str],
    revision: str | None = None,
    *,
    allow_patterns: list[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
) -> Path:
    """A local export folder: ``repo_id_or_path`` itself when it is a folder, else a download of that Hub repository.

    Downloads go through ``huggingface_hub.snapshot_download`` (cached; the token from ``HF_TOKEN`` or the login
    is used for private repositories).

    Args:
        repo_id_or_path: a local export folder or a Hub id ``namespace/name``.
        revision: branch, tag or commit on the Hub (not allowed with a local folder).
        allow_patterns: only download the files matching these patterns (default: every file).
        cache_dir: the Hub cache (default ``$HF_HUB_CACHE``).
        endpoint: the Hub (default ``$HF_ENDPOINT`` or huggingface.co).

    Returns:
        The folder holding ``config.json`` and the heads.

    Raises:
        FileNotFoundError: neither a local folder nor a reachable Hub repository (the message says which, and how
            to log in for a private one), or the download holds no ``config.json``.
        ValueError: ``revision`` with a local folder.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = os.fspath(repo_id_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repositories; {path} is a local folder")
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the export folder or a Hub repository id")
    if not is_hub_id(name):
        raise FileNotFoundError(f"{name!r} is neither a local export folder nor a Hub repository id "
                                "(namespace/name)")
    try:
        folder = Path(snapshot_download(name, revision=revision, allow_patterns=allow_patterns,
                                        cache_dir=cache_dir, endpoint=hub_endpoint(endpoint)))
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"Hub repository {name} has no revision {revision!r}") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(f"no Hub repository {name} (if it is private, log in with `hf auth login` or set "
                                "HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(f"{name} is not in the local Hub cache and the Hub cannot be reached (is "
                                "HF_HUB_OFFLINE set?)") from e
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"could not download {name} from the Hub: {e}") from e
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"Hub repository {name} has no config.json: is it a Medusa heads repository?")
    return folder


__all__ = ["FASTERDECODING_WEIGHTS", "decoder_files", "download_export", "hub_endpoint", "is_hub_id"]
