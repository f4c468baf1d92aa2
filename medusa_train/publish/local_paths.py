"""Local paths stay on the machine: what a published repository names instead of them.

An export records where its base model was loaded from (``base_model_name_or_path``, the ``medusa_train_model``
config), and an evaluation records its command line, both often absolute local paths (``/home/alice/models/...``).
Published, they tell nothing to a reader, leak the publisher's file system, and make loaders look for folders that
do not exist. The published base is the Hub id when one is known (``medusa-publish base_model=``, a recorded Hub
id, or the ``model/`` config's ``hub_id``), else the file or folder name with a note in the card; any other absolute
path in the published JSON and text files becomes its last component.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from medusa_train.loading.hub import is_hub_id

# An absolute POSIX path (or ~/...) standing on its own: not the second half of a relative path ("vllm/config.json"),
# of a URL ("https://huggingface.co/..."), of a ratio ("tokens/s") or an HTML tag ("</details>").
_LOCAL_PATH = re.compile(r"(?<![\w:/.~<-])~?/[^\s`'\"()<>\[\]{}|,;=]+")


def is_local_path(value: str) -> bool:
    """Whether ``value`` is an absolute local path (``/...`` or ``~...``)."""
    return value.startswith(("/", "~"))


def public_name(path: str) -> str:
    """The last component of a local path (``/home/a/models/stories260K.bin`` -> ``stories260K.bin``)."""
    return PurePosixPath(path.rstrip("/")).name or path


def scrub_text(text: str) -> str:
    """``text`` with every absolute local path replaced by its last component."""
    return _LOCAL_PATH.sub(lambda m: public_name(m.group()), text)


def scrub(value: Any) -> Any:
    """A JSON value with every string passed through :func:`scrub_text` (keys unchanged)."""
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    return value


def published_base(recorded: str, model_record: Any, override: str | None) -> tuple[str, bool]:
    """The base model a published config and card name, and whether it is a Hub id.

    Args:
        recorded: the export's ``base_model_name_or_path`` (or the original base of a Medusa-2 export).
        model_record: the recorded ``model/`` config (``medusa_train_model``), whose ``hub_id`` names the Hub
            repository a local copy came from.
        override: ``medusa-publish base_model=``.

    Returns:
        ``(name, is_hub_id)``: the override, the recorded name when it is a Hub id, the ``model/`` config's
        ``hub_id``, else the local path's last component (``False``: loaders cannot fetch it).
    """
    if override:
        return override, True
    if is_hub_id(recorded):
        return recorded, True
    hub_id = model_record.get("hub_id") if isinstance(model_record, dict) else None
    if isinstance(hub_id, str) and hub_id:
        return hub_id, True
    return public_name(recorded), False


__all__ = ["is_local_path", "public_name", "published_base", "scrub", "scrub_text"]
