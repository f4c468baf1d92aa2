"""Tokenized conversations on disk, once per node: ``datasets.Dataset.save_to_disk`` folders keyed by what decides
their content.

The key (:func:`cache_key`) hashes the tokenizer (``datasets``' own ``Hasher``, which reads its vocabulary, merges
and added tokens), the chat template, the end-of-turn ids, ``max_length``, every conversation (role and text, in
order) and :data:`FORMAT` (bumped when the tokenization's output changes). Any change makes a new key, so a folder is
never stale; an old key's folder is left for any run that returns to that data, whatever its ``output_dir``.
Training keeps them in ``$MEDUSA_CACHE/tokenized`` (``~/.cache/medusa-train``, beside the converted models; delete
it to reclaim the space), not in ``output_dir``: a run refused after tokenizing (too little data) leaves its folder
as it was.

Under a launcher the local main process of each node (``LOCAL_RANK`` 0) tokenizes and writes the folder while the
other ranks wait at a barrier, then every rank memory-maps it (:func:`datasets.load_from_disk`): one tokenization
per node, and the node's ranks share the pages instead of holding a copy each. A folder is written under a temporary
name and renamed into place whole (:func:`publish`), so a reader or a killed run never sees half of one, and two
nodes writing the same key on a shared file system both end with one complete folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from medusa_train.files.folders import publish_folder

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

FORMAT = 1  # the columns and rules of medusa_train.data.dataset.tokenize_table; bump when they change
COMPLETE = "dataset_info.json"  # written by save_to_disk, present in every finished folder


def conversations_digest(conversations: Sequence[Any]) -> str:
    """A BLAKE2b digest of the conversations, in order (each as canonical JSON)."""
    digest = hashlib.blake2b(digest_size=16)
    for c in conversations:
        digest.update(json.dumps(c, ensure_ascii=False, sort_keys=True).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def cache_key(tokenizer: Any, template: str, end_ids: set[int], max_length: int, conversations: Sequence[Any]) -> str:
    """The folder name of these conversations tokenized this way (hex digest, see the module docstring)."""
    from datasets.fingerprint import Hasher

    parts = [FORMAT, Hasher.hash(tokenizer), template, sorted(end_ids), max_length,
             conversations_digest(conversations)]
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()


def publish(build: Callable[[Path], None], folder: Path) -> None:
    """``build(tmp)`` writes a ``save_to_disk`` folder into a temporary sibling of ``folder``, renamed into place
    whole (:func:`~medusa_train.files.folders.publish_folder`); when another process published ``folder`` first,
    this copy is dropped (both are the same content).

    Raises:
        OSError: the rename failed and ``folder`` holds no finished dataset (no :data:`COMPLETE` file).
    """
    publish_folder(folder, build, published=lambda found: (found / COMPLETE).is_file())


def tokenized_once(folder: Path, build: Callable[[Path], None], *, local_main: bool,
                   barrier: Callable[[], None] | None) -> datasets.Dataset:
    """The dataset in ``folder``: built by the local main process if missing (:func:`publish`), then loaded by every
    rank after ``barrier`` (collective: every rank calls it; None with one process).

    Raises:
        FileNotFoundError: after the barrier the folder is still missing on this rank (the local main process failed,
            or ``folder`` is on a disk another node's writer does not share and no writer ran here).
    """
    import datasets

    if local_main and not (folder / COMPLETE).is_file():
        publish(build, folder)
    elif local_main:
        log.info("tokenized: reusing %s", folder)
    if barrier is not None:
        barrier()
    if not (folder / COMPLETE).is_file():
        raise FileNotFoundError(f"tokenized conversations {folder} missing after the local main process wrote them: "
                                "see rank 0's log on this node")
    return datasets.load_from_disk(str(folder))
