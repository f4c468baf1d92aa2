"""Which tree a tree decoder uses: the setting, else the export's tuned ``medusa_choices.json``, else a default; for
drafters that grow an EAGLE-2 dynamic tree, whether it grows one (:func:`resolve_dynamic_tree`); and the composite
tree's budget split (:func:`resolve_composite`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from medusa_train.export.tree_files import COMPOSITE_FILE, DYNAMIC_TREE_FILE, read_tree_files
from medusa_train.files.text_files import read_text
from medusa_train.tree.buffers import default_medusa_choices


def resolve_medusa_choices(setting: Any, export_dir: str, num_heads: int, topk: int) -> list[list[int]]:
    """The tree to decode with.

    Args:
        setting: a list of paths (Python or OmegaConf), a path to a JSON file holding one, or None.
        export_dir: the export folder, searched for ``medusa_choices.json`` (written by ``medusa-tune-tree``) when
            ``setting`` is None.
        num_heads, topk: cut Medusa's default tree to these when neither gives a tree
            (:func:`~medusa_train.tree.buffers.default_medusa_choices`).

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
    if not isinstance(setting, (list, tuple)):
        return setting  # not a list of paths: refused by the tree's validation, the value named
    return [list(p) if isinstance(p, (list, tuple)) else p for p in setting]


def resolve_dynamic_tree(setting: Any, medusa_choices: Any, export_dir: str, model: Any,
                         setting_name: str = "dynamic_tree") -> tuple[Any, str | None]:
    """The dynamic tree to decode over, and where it came from: the ``dynamic_tree`` setting when given; else, when
    no static tree is set (``medusa_choices`` None) and ``model``'s drafter grows dynamic trees
    (:func:`~medusa_train.models.catalog.grows_dynamic_trees`), the export's tuned ``dynamic_tree.json``
    (``medusa-tune-tree``) unless it records the static tree as faster beyond the noise (``chosen.static_faster``,
    :func:`inference.tuning.dynamic.prefer_faster_kind`); else None (the static tree).

    Args:
        setting: ``dynamic_tree`` as given (``{depth, topk, total}``, a triple, or None).
        medusa_choices: the static tree as given (None: not set).
        export_dir: the export folder.
        model: the :class:`~medusa_train.models.speculative.SpeculativeModel` that will decode.
        setting_name: the setting's name in ``source`` (e.g. ``decoder.tree.dynamic_tree``).

    Returns:
        ``(shape, source)``: ``shape`` the setting as given or ``{"depth", "topk", "total"}`` from the file, None for
        the static tree; ``source`` ``setting_name``, ``"export dynamic_tree.json"`` or None.

    Raises:
        ValueError: ``dynamic_tree.json`` that is not UTF-8 JSON of its shape (the file and field named).
    """
    from medusa_train.models.catalog import grows_dynamic_trees

    if setting is not None:
        return setting, setting_name
    if medusa_choices is not None:
        return None, None
    tuned = read_tree_files(export_dir, head_vocab=model.heads.spec.out_size).get("dynamic_tree")
    if tuned is None or not grows_dynamic_trees(model) or tuned["chosen"].get("static_faster", False):
        return None, None  # no tuned dynamic tree, or the static tree decoded faster beyond the noise
    return {key: tuned[key] for key in ("depth", "topk", "total")}, f"export {DYNAMIC_TREE_FILE}"


def resolve_composite(settings: Any, tuned: dict[str, Any] | None, heads_nodes: int) -> tuple[Any, str]:
    """The composite tree's budget split: each of ``settings``' fields (``nodes``, ``lookup_length``,
    ``lookup_matches``, ``max_matching_ngram_size``) as set, else the export's ``composite_tree.json`` (``tuned``),
    else the default (transformers' prompt lookup: 10 tokens, n-grams up to 2; one match; ``nodes`` the heads'
    ``heads_nodes`` plus the lookup drafts').

    Returns:
        ``(composite, source)``: a :class:`~medusa_train.tree.composite.CompositeTree` and where its fields came
        from (``settings``, ``export composite_tree.json``, ``default``, joined by ``+`` when mixed).

    Raises:
        ValueError: a split that is not valid (``decoder.composite.<field>`` named, e.g. ``nodes`` below the lookup
            drafts' tokens).
    """
    from medusa_train.tree.composite import DEFAULTS, KEYS, setting_split

    values, sources = {}, []
    for key in KEYS:
        if getattr(settings, key) is not None:
            values[key], where = getattr(settings, key), "settings"
        elif tuned is not None:
            values[key], where = tuned[key], f"export {COMPOSITE_FILE}"
        elif key in DEFAULTS:
            values[key], where = DEFAULTS[key], "default"
        else:
            continue
        if where not in sources:
            sources.append(where)
    if "nodes" not in values:
        values["nodes"] = heads_nodes + values["lookup_length"] * values["lookup_matches"]
        if "default" not in sources:
            sources.append("default")
    return setting_split(**values), "+".join(sources)
