"""Reading from the Hub: published exports (download, decoder arguments) and the base model's license.

``HF_ENDPOINT`` is read when a function runs (``huggingface_hub`` reads it once, at import), so a process can
point at a mirror or a local test server after importing transformers.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 10.0  # the license lookup is optional: never wait long for an unreachable Hub
# What MedusaDecoder needs from a published export (vllm/ and eval/ are not downloaded for it); the .pt copy for
# FasterDecoding's loader only when a repository has no safetensors (FasterDecoding's own).
DECODER_FILES = ["config.json", "medusa_lm_head.safetensors", "token_map.safetensors", "medusa_choices.json"]
FASTERDECODING_WEIGHTS = "medusa_lm_head.pt"


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


@dataclass(frozen=True)
class LicenseInfo:
    """A model card's license fields (``license`` plus ``license_name`` / ``license_link`` for ``other``) and where
    they came from, as a phrase for the card (``"from the org/base model card"``)."""

    license: str
    name: str | None = None
    link: str | None = None
    source: str = ""


def card_license(readme: str, source: str) -> LicenseInfo | None:
    """The license in a model card's YAML metadata, or None."""
    match = re.match(r"\A---\s*\n(.*?\n)---\s*(\n|\Z)", readme, re.DOTALL)
    if not match:
        return None
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    return _license_from_mapping(meta, source)


def _license_from_mapping(meta: Any, source: str) -> LicenseInfo | None:
    if not isinstance(meta, dict) or not isinstance(meta.get("license"), str):
        return None
    name, link = meta.get("license_name"), meta.get("license_link")
    return LicenseInfo(meta["license"], name if isinstance(name, str) else None,
                       link if isinstance(link, str) else None, source)


def base_model_license(base_model: str, endpoint: str | None = None, token: str | None = None) -> LicenseInfo | None:
    """The license of the base model: its local folder's ``README.md``, else its Hub model card.

    Never raises: an unreachable Hub, a missing card or a local file without a card give None and a log line, and
    the card then says the license is unknown.
    """
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    path = Path(base_model).expanduser()
    if path.is_dir():
        readme = path / "README.md"
        found = (card_license(readme.read_text(encoding="utf-8"), "from the base model folder's README.md")
                 if readme.is_file() else None)
        if found is None:
            log.warning("base model folder %s has no model card with a license", path)
        return found
    if not is_hub_id(base_model):
        log.warning("base model %s is a local file: its license cannot be looked up", base_model)
        return None
    try:
        info = HfApi(endpoint=hub_endpoint(endpoint)).model_info(base_model, token=token, timeout=LOOKUP_TIMEOUT_S)
    except (HfHubHTTPError, OfflineModeIsEnabled, httpx2.HTTPError, OSError) as e:
        log.warning("could not read the license of %s from the Hub (%s)", base_model, type(e).__name__)
        return None
    data = info.card_data.to_dict() if info.card_data is not None else {}
    return _license_from_mapping(data, f"from the {base_model} model card")


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


def pretrained_decoder_kwargs(
    repo_or_dir: str | os.PathLike[str],
    revision: str | None = None,
    *,
    model: Any = None,
    dtype: str | None = None,
    device: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    **decoder_kwargs: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``MedusaDecoder(...)`` for a published export or a local one.

    Downloads the heads (``config.json``, weights, token map, ``medusa_choices.json``: not ``vllm/`` nor
    ``eval/``), then loads the base model named by the export (its recorded ``model/`` config, else
    ``base_model_name_or_path``, from the Hub when it is an id) with :func:`~medusa_train.loading.medusa.load_medusa`.

    Args:
        repo_or_dir: Hub id or local export folder.
        revision: Hub branch, tag or commit.
        model: optional ``model/`` config overriding the base model recorded in the export.
        dtype, device: overrides of the base model's dtype and device; the heads follow.
        cache_dir, endpoint: see :func:`download_export`.
        decoder_kwargs: further ``MedusaDecoder`` arguments (``topk``, ``acceptance``, ``medusa_choices``, ...).

    Returns:
        ``{"model": MedusaModel, "tokenizer": ..., "medusa_choices": [[int]], **decoder_kwargs}``; the tree is the
        export's ``medusa_choices.json``, else the decoder's default tree (a warning).

    Raises:
        FileNotFoundError: see :func:`download_export`; ValueError: heads that do not fit the base model.
    """
    from medusa_train.loading.medusa import load_medusa
    from medusa_train.tuning.tune import read_tree_files

    folder = download_export(repo_or_dir, revision, allow_patterns=DECODER_FILES, cache_dir=cache_dir,
                             endpoint=endpoint)
    if not (folder / DECODER_FILES[1]).is_file():
        folder = download_export(repo_or_dir, revision, allow_patterns=DECODER_FILES + [FASTERDECODING_WEIGHTS],
                                 cache_dir=cache_dir, endpoint=endpoint)
    medusa_model, tokenizer, _ = load_medusa(str(folder), model=model, dtype=dtype, device=device)
    if decoder_kwargs.get("medusa_choices") is None:
        choices = read_tree_files(folder).get("medusa_choices")
        if choices is None:
            from inference.decoders.medusa import MedusaDecoder, default_medusa_choices

            topk = decoder_kwargs.get("topk") or inspect.signature(MedusaDecoder).parameters["topk"].default
            choices = default_medusa_choices(medusa_model.heads.spec.num_heads, topk)
            log.warning("%s has no medusa_choices.json: using the default tree of %d nodes", repo_or_dir,
                        len(choices))
        decoder_kwargs["medusa_choices"] = choices
    decoder_kwargs.setdefault("tokenizer", tokenizer)
    return {"model": medusa_model, **decoder_kwargs}
