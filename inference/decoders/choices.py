"""Which tree a Medusa decoder uses: the setting, else the export's tuned ``medusa_choices.json``, else a default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from inference.tree import default_medusa_choices
from medusa_train.export.tree_files import read_tree_files
from medusa_train.text_files import read_text


def resolve_medusa_choices(setting: Any, export_dir: str, num_heads: int, topk: int) -> list[list[int]]:
    """The tree to decode with.

    Args:
        setting: a list of paths (Python or OmegaConf), a path to a JSON file holding one, or None.
        export_dir: the export folder, searched for ``medusa_choices.json`` (written by ``medusa-tune-tree``) when
            ``setting`` is None.
        num_heads, topk: cut Medusa's default tree to these when neither gives a tree
            (:func:`~inference.tree.default_medusa_choices`).

    Returns:
        The paths (validated later, by the decoder's tree buffers).

    Raises:
        FileNotFoundError: ``setting`` is a path that does not exist.
        ValueError: the file is not UTF-8 (line and byte named) or not valid JSON.
    """
    if setting is None:
        tuned = read_tree_files(export_dir).get("medusa_choices")
        return tuned if tuned is not None else default_medusa_choices(num_heads, topk)
    if isinstance(setting, (str, Path)):
        path = Path(setting)
        if not path.is_file():
            raise FileNotFoundError(
                f"medusa_choices={str(setting)!r}: no such file (give a list of paths or a JSON file)")
        try:
            return json.loads(read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"medusa_choices file {path} is not valid JSON: {e}") from e
    if OmegaConf.is_config(setting):
        return OmegaConf.to_container(setting)
    return [list(p) for p in setting]
