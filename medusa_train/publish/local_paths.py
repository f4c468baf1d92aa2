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


def check_model_name(name: Any, field: str, fix: str) -> str:
    """``name`` when the Hub would take it as a model name (``name`` or ``namespace/name``: letters, digits, ``-``,
    ``_``, ``.``, at most 96 characters each; huggingface_hub's ``validate_repo_id``), so that nothing but a name
    reaches the card's code snippets and metadata (no newline, quote, backtick or markup).

    Raises:
        ValueError: ``{field} {name!r} is not a valid model name ...``, then ``fix``.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if not isinstance(name, str):
            raise HFValidationError(f"a name is a string, got {type(name).__name__}")
        validate_repo_id(name)
    except HFValidationError as e:
        raise ValueError(f"{field} {name!r} is not a valid model name as the Hub validates them ({e}); {fix}") from e
    return name


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

    Raises:
        ValueError: the name is not one the Hub takes (:func:`check_model_name`; where it came from named).
    """
    fix = "publish with base_model=<Hub id of the base model>"
    if override:
        return check_model_name(override, "base_model", "give the Hub id of the base model (namespace/name)"), True
    if is_hub_id(recorded):
        return recorded, True
    hub_id = model_record.get("hub_id") if isinstance(model_record, dict) else None
    if isinstance(hub_id, str) and hub_id:
        return check_model_name(hub_id, "the export's config.json medusa_train_model.hub_id", fix), True
    if not recorded:  # none recorded (a Medusa-2 export without its original base): nothing to name
        return "", False
    return check_model_name(public_name(recorded), f"the name of the local base model at {recorded!r}:", fix), False


__all__ = ["check_model_name", "is_local_path", "public_name", "published_base", "scrub", "scrub_text"]
