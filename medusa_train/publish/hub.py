"""Reading the base model's license from the Hub (for the model card).

``HF_ENDPOINT`` is read when a function runs (``huggingface_hub`` reads it once, at import), so a process can
point at a mirror or a local test server after importing transformers.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from medusa_train.loading.hub import hub_endpoint, is_hub_id

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 10.0  # the license lookup is optional: never wait long for an unreachable Hub


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
