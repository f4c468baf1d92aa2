"""A :class:`~inference.decoders.tree.TreeDecoder` from a published export (Hub id) or a local export folder.

What ``TreeDecoder.from_pretrained`` runs: the heads and tree downloaded (:func:`medusa_train.loading.hub.
download_export`), the base model loaded as the export records it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from inference.decoders.choices import resolve_dynamic_tree, resolve_medusa_choices
from medusa_train.export.tree_files import CHOICES_FILE
from medusa_train.export.writer import weights_files
from medusa_train.loading.hub import FASTERDECODING_WEIGHTS, decoder_files, download_export
from medusa_train.loading.export import load_export
from medusa_train.tree.buffers import TOPK

log = logging.getLogger(__name__)


def pretrained_decoder_kwargs(
    repo_or_dir: str | os.PathLike[str],
    revision: str | None = None,
    *,
    model: Any = None,
    dtype: str | None = None,
    device: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    endpoint: str | None = None,
    trust_remote_code: bool = False,
    **decoder_kwargs: Any,
) -> dict[str, Any]:
    """Keyword arguments of ``TreeDecoder(...)`` for a published export or a local one.

    Downloads the heads (``config.json``, weights, token map, ``medusa_choices.json``, ``dynamic_tree.json``: not
    ``vllm/`` nor ``eval/``), then loads the base model named by the export (its recorded ``model/`` config, else
    ``base_model_name_or_path``, from the Hub when it is an id) with :func:`~medusa_train.loading.export.load_export`.

    Args:
        repo_or_dir: Hub id or local export folder.
        revision: Hub branch, tag or commit.
        model: optional ``model/`` config overriding the base model recorded in the export.
        dtype, device: overrides of the base model's dtype and device; the heads follow.
        cache_dir, endpoint: see :func:`~medusa_train.loading.hub.download_export`.
        trust_remote_code: run the base model's own Python code when it has some; only this argument (or
            ``model``) turns it on, never the downloaded config.json.
        decoder_kwargs: further ``TreeDecoder`` arguments (``topk``, ``acceptance``, ``medusa_choices``, ...).

    Returns:
        ``{"model": SpeculativeModel, "tokenizer": ..., "medusa_choices": [[int]], **decoder_kwargs}``; the tree is the
        export's ``medusa_choices.json``, else the decoder's default tree (a warning); for drafters that grow an
        EAGLE-2 dynamic tree, ``dynamic_tree`` is the export's ``dynamic_tree.json`` unless ``dynamic_tree`` or
        ``medusa_choices`` is given (:func:`~inference.decoders.choices.resolve_dynamic_tree`).

    Raises:
        FileNotFoundError: see :func:`~medusa_train.loading.hub.download_export`. ValueError: a malformed file in
            the export, heads that do not fit the base model. OSError: the base model needs its own code and
            ``trust_remote_code`` is off (the fix named).
    """
    folder = download_export(repo_or_dir, revision, allow_patterns=decoder_files(), cache_dir=cache_dir,
                             endpoint=endpoint)
    if not any((folder / name).is_file() for name in weights_files()):
        folder = download_export(repo_or_dir, revision, allow_patterns=decoder_files() + [FASTERDECODING_WEIGHTS],
                                 cache_dir=cache_dir, endpoint=endpoint)
    medusa_model, tokenizer, _ = load_export(str(folder), model=model, dtype=dtype, device=device,
                                             trust_remote_code=trust_remote_code)
    shape, source = resolve_dynamic_tree(decoder_kwargs.get("dynamic_tree"), decoder_kwargs.get("medusa_choices"),
                                         str(folder), medusa_model)
    if shape is not None and decoder_kwargs.get("dynamic_tree") is None:
        log.info("%s: decoding over the dynamic tree of %s", repo_or_dir, source)
        decoder_kwargs["dynamic_tree"] = shape
    if decoder_kwargs.get("medusa_choices") is None:
        choices = resolve_medusa_choices(None, str(folder), medusa_model.heads.spec.num_heads,
                                         decoder_kwargs.get("topk") or TOPK)
        if not (folder / CHOICES_FILE).is_file():
            log.warning("%s has no medusa_choices.json: using the default tree of %d nodes", repo_or_dir,
                        len(choices))
        decoder_kwargs["medusa_choices"] = choices
    decoder_kwargs.setdefault("tokenizer", tokenizer)
    return {"model": medusa_model, **decoder_kwargs}


__all__ = ["pretrained_decoder_kwargs"]
