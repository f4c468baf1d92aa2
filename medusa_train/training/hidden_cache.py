"""Hidden-state cache: run the frozen base once per sequence, then train the heads from disk for many epochs.

With the base frozen (Medusa-1), its features and greedy tokens never change, so they can be computed once.
:func:`build_hidden_cache` splits a tokenized dataset over ranks (row i goes to rank ``i % world_size``); each rank
writes one safetensors shard holding its rows' target features ``[N_tokens, H]`` each (base dtype; exactly the ones
the drafter reads, named as in :mod:`medusa_train.features`: the last hidden state :data:`FINAL` is stored, and
batched, as ``hidden``, a layer's under its name, e.g. ``layer3``), base argmax tokens ``[N_tokens]`` and row
offsets, through a temporary file renamed into place, next to a JSON description with the features' names, a
fingerprint of the data and the base model's weights (:func:`base_weights_digest`: not its path, so a cache follows a
moved checkout, and a base retrained or requantized in place is not mistaken for the old one) and the shard file's
size and sha256. A shard whose description matches and whose file still has that size and checksum is reused (a
resumed run skips the base entirely); one built for other data is rebuilt, saying why; one written by another cache
version or for other features, or a damaged one, is rebuilt with a warning saying why. :class:`CachedHiddenDataset`
reads rows back lazily (memory-mapped) from all shards, so the Trainer's sampler sees the same rows in the same order
as without the cache, and :class:`HiddenCollator` pads them.

Every rank reads every shard: ``output_dir`` (or ``hidden_cache_dir``) must be on a file system all ranks share.
Disk use is ``tokens * features * H * bytes(dtype)``: 1,000 conversations of 512 tokens with SmolLM2 (H=576, bf16)
take 0.6 GB per feature; a 7B model (H=4096) on all of ShareGPT would take terabytes, so the cache suits small data
or many epochs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from medusa_train.atomic import atomic_write, atomic_write_text
from medusa_train.checksums import file_sha256
from medusa_train.data.collate import Collator
from medusa_train.features import FINAL, feature_layer, target_features
from medusa_train.training.base_placement import gathered
from medusa_train.training.step import FrozenBase, feature_key

log = logging.getLogger(__name__)

# 2: descriptions hold the shard's size and sha256; 3: the base is named by its weights' digest; 4: shards hold the
# named target features the drafter reads (descriptions list them)
CACHE_VERSION = 4
# The per-token entries of a cached row that are not target features.
TOKEN_KEYS = ("base_argmax", "labels", "input_ids")
# Elements read from each base tensor for its digest (at an odd stride): a few MB for any model size.
DIGEST_SAMPLES = 4096


@torch.no_grad()
def base_weights_digest(model: nn.Module) -> str:
    """What identifies a base model's hidden states, independent of where its files are: sha256 (16 hex digits) of
    the model config (its path and transformers version left out: RoPE, norm epsilon and attention settings change
    the hidden states too) and of every state-dict entry's name, shape, dtype and about :data:`DIGEST_SAMPLES` of
    its elements at an odd stride (not one column of a square matrix; a fine-tuned, merged or requantized base
    changes every sampled tensor; reading a sample keeps this a few MB for a 7B model)."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        settings = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        with gathered(tensor):  # a ZeRO-3 partitioned weight, gathered alone (collective: every rank, same order)
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // DIGEST_SAMPLES) | 1].contiguous().cpu()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()[:16]


def _lockstep_extra(own: int, device: torch.device | str) -> int:
    """How many forwards this rank must add so that every rank runs as many as the busiest one (``own``: its
    own count); collective (``all_reduce`` MAX over the default process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    most = torch.tensor([own], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most.item()) - own


def dataset_fingerprint(dataset: Any, base_digest: str, dtype: torch.dtype) -> str:
    """sha256 of every row's ``input_ids`` plus the base model's :func:`base_weights_digest` and dtype (16 hex
    digits)."""
    digest = hashlib.sha256(f"v{CACHE_VERSION}|{base_digest}|{dtype}|{len(dataset)}".encode())
    for row in dataset["input_ids"]:
        digest.update(np.asarray(row, dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def check_features(features: Sequence[str]) -> tuple[str, ...]:
    """``features`` as a tuple after checking them: at least one, each :data:`FINAL` or ``layer{i}``, none twice.

    Raises:
        ValueError: an empty, unknown or repeated feature name.
    """
    features = tuple(features)
    if not features:
        raise ValueError(f"the hidden cache needs at least one target feature (e.g. {FINAL!r})")
    for name in features:
        feature_layer(name)
    if len(set(features)) != len(features):
        raise ValueError(f"target features {list(features)} name one feature twice; give each once")
    return features


def shard_name(split: str, rank: int, world_size: int) -> str:
    return f"{split}-shard-{rank:05d}-of-{world_size:05d}"


@dataclass(frozen=True)
class ShardInfo:
    """Description written next to a shard (``<shard>.json``)."""

    fingerprint: str
    rows: list[int]
    hidden_size: int
    dtype: str
    size: int
    sha256: str
    features: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"version": CACHE_VERSION, "fingerprint": self.fingerprint, "rows": self.rows,
                "hidden_size": self.hidden_size, "dtype": self.dtype, "size": self.size, "sha256": self.sha256,
                "features": self.features}


@dataclass(frozen=True)
class ShardProblem:
    """Why a shard cannot be reused; ``warn``: its rebuild is worth a warning (not missing or built for other
    data, the ordinary cases)."""

    reason: str
    warn: bool = False


def _shard_problem(folder: Path, name: str, fingerprint: str, rows: list[int], features: Sequence[str],
                   verify: bool) -> ShardProblem | None:
    """None when the shard can be reused, else why not: missing, written by another cache version, built for other
    data or other features, or (checked by size, and with ``verify`` by sha256) changed since it was written."""
    meta_path, data_path = folder / f"{name}.json", folder / f"{name}.safetensors"
    if not (meta_path.is_file() and data_path.is_file()):
        return ShardProblem("missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return ShardProblem("its description is unreadable", warn=True)
    if meta.get("version") != CACHE_VERSION:
        return ShardProblem(f"written by cache version {meta.get('version')} (this one is {CACHE_VERSION})",
                            warn=True)
    if not (meta.get("fingerprint") == fingerprint
            and meta.get("rows") == rows):
        return ShardProblem("built for other data (another dataset, base model or dtype)")
    if meta.get("features") != list(features):
        return ShardProblem(f"built for other target features ({meta.get('features')}, not {list(features)})",
                            warn=True)
    if data_path.stat().st_size != meta.get("size"):
        return ShardProblem(f"damaged: {data_path.stat().st_size} bytes, {meta.get('size')} when written", warn=True)
    if verify and file_sha256(data_path) != meta.get("sha256"):
        return ShardProblem("damaged: its sha256 differs from the one recorded when it was written (same size)",
                            warn=True)
    return None


@torch.no_grad()
def build_hidden_cache(
    base: FrozenBase,
    dataset: Any,
    folder: str | os.PathLike[str],
    *,
    split: str,
    fingerprint: str,
    collator: Collator,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    features: Sequence[str] = (FINAL,),
    lockstep: bool = False,
) -> Path:
    """Write this rank's shard of the cache for ``dataset`` (rows ``rank, rank + world_size, ...``).

    Args:
        base: the frozen base with its backbone.
        dataset: rows with ``input_ids`` (and ``labels``), e.g. from ``build_dataset``.
        folder: the cache folder (created).
        split: ``train`` or ``eval``; part of the shard's file name.
        fingerprint: :func:`dataset_fingerprint` of ``dataset``; a shard with the same fingerprint is reused.
        collator: pads token batches (right padding, ``attention_mask``).
        batch_size: rows per base forward pass.
        rank, world_size: this process's share.
        device: where the base runs.
        features: the target features to store (:mod:`medusa_train.features` names; the drafter's); a shard
            written for other features is rebuilt.
        lockstep: every rank runs as many base forwards as the busiest one (one-token forwards make up the
            difference, a reused shard counting none): a base partitioned by ZeRO-3 gathers each layer from all ranks,
            so a rank that stopped early would leave the others waiting. Collective: every rank must call this.

    Returns:
        The shard's safetensors path.

    Raises:
        ValueError: an empty, unknown or repeated feature name, or a layer the base does not have.
    """
    features = check_features(features)
    layers = [feature_layer(f) for f in features if f != FINAL]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = shard_name(split, rank, world_size)
    rows = list(range(rank, len(dataset), world_size))
    target = folder / f"{name}.safetensors"
    problem = _shard_problem(folder, name, fingerprint, rows, features, verify=True)
    if problem is None:
        log.info("hidden cache: reusing %s (%d rows)", target, len(rows))
        if lockstep:
            _idle_forwards(base, _lockstep_extra(0, device), layers, device)
        return target
    if problem.reason.startswith("damaged"):
        log.warning("hidden cache: %s is %s; rebuilding it", target, problem.reason)
    elif problem.reason != "missing":
        log.log(logging.WARNING if problem.warn else logging.INFO, "hidden cache: rebuilding %s (%s)", target,
                problem.reason)
    lengths = [len(dataset[i]["input_ids"]) for i in rows]
    parts: dict[str, list[torch.Tensor | None]] = {f: [None] * len(rows) for f in features}
    argmax_parts: list[torch.Tensor | None] = [None] * len(rows)
    # Batches of similar lengths waste less on padding; the shard keeps the rows' own order.
    by_length = sorted(range(len(rows)), key=lambda j: lengths[j], reverse=True)
    if lockstep:
        _idle_forwards(base, _lockstep_extra(-(-len(rows) // batch_size), device), layers, device)
    for start in range(0, len(by_length), batch_size):
        chunk = by_length[start : start + batch_size]
        batch = collator([dataset[rows[j]] for j in chunk])
        named, _ = target_features(base.backbone, batch["input_ids"].to(device), layers,
                                   attention_mask=batch["attention_mask"].to(device), use_cache=False)  # [B, T, H]
        argmax = base.logits(named[FINAL]).argmax(-1)  # [B, T]
        for b, j in enumerate(chunk):
            for f in features:
                parts[f][j] = named[f][b, : lengths[j]].to("cpu")
            argmax_parts[j] = argmax[b, : lengths[j]].to("cpu", torch.int64)
    H = int(base.lm_head.weight.shape[1])
    dtype = base.lm_head.weight.dtype
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {feature_key(f): torch.cat(parts[f]).contiguous() if rows else torch.zeros(0, H, dtype=dtype)
               for f in features}
    tensors["base_argmax"] = torch.cat(argmax_parts) if argmax_parts else torch.zeros(0, dtype=torch.int64)
    tensors["offsets"] = offsets
    atomic_write(target, lambda p: save_file(tensors, str(p)))
    info = ShardInfo(fingerprint=fingerprint, rows=rows, hidden_size=H,
                     dtype=str(tensors[feature_key(features[0])].dtype), size=target.stat().st_size,
                     sha256=file_sha256(target), features=list(features))
    atomic_write_text(folder / f"{name}.json", json.dumps(info.to_json()))  # last: a shard without it is rebuilt
    log.info("hidden cache: wrote %s (%d rows, %d tokens)", target, len(rows), int(offsets[-1]))
    return target


def _idle_forwards(base: FrozenBase, count: int, layers: list[int], device: torch.device | str) -> None:
    """``count`` one-token backbone forwards whose outputs are dropped (see ``lockstep``), run first: the gathers they
    join happen in the same order on every rank whatever the rows."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    for _ in range(count):
        target_features(base.backbone, ids, layers, attention_mask=torch.ones_like(ids), use_cache=False)


class CachedHiddenDataset(torch.utils.data.Dataset):
    """Rows of a tokenized dataset with their cached target features, in the dataset's order.

    Item i: ``{"hidden": [T_i, H] (FINAL), "layer<j>": [T_i, H] (each other feature), "base_argmax": [T_i] long,
    "labels": [T_i] long, "input_ids": [T_i] long}`` (the token ids are the path Hydra heads read).

    Raises:
        ValueError: an empty, unknown or repeated feature name.
        FileNotFoundError: a shard of ``world_size`` is missing, was written by another cache version, built for other
            data (fingerprint) or other ``features``, or has changed size since it was written (its owner rank
            verified its checksum in :func:`build_hidden_cache`).
    """

    def __init__(
        self, dataset: Any, folder: str | os.PathLike[str], *, split: str, fingerprint: str, world_size: int,
        features: Sequence[str] = (FINAL,),
    ) -> None:
        self.dataset = dataset
        self.keys = [feature_key(f) for f in check_features(features)]
        self.folder = Path(folder)
        self.names = [shard_name(split, r, world_size) for r in range(world_size)]
        self.where: dict[int, tuple[int, int]] = {}  # row -> (shard, position in shard)
        for s, name in enumerate(self.names):
            rows = list(range(s, len(dataset), world_size))
            problem = _shard_problem(self.folder, name, fingerprint, rows, features, verify=False)
            if problem is not None:
                raise FileNotFoundError(
                    f"hidden cache shard {self.folder / name}.safetensors is {problem.reason}; it is rebuilt at the "
                    "start of training (delete the folder to force it)"
                )
            for j, row in enumerate(rows):
                self.where[row] = (s, j)
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def _open(self, s: int) -> Any:
        if s not in self._handles:  # opened lazily, so each DataLoader worker gets its own handle
            handle = safe_open(str(self.folder / f"{self.names[s]}.safetensors"), framework="pt")
            self._handles[s] = handle
            self._offsets[s] = handle.get_tensor("offsets")
        return self._handles[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, j = self.where[int(i)]
        handle = self._open(s)
        row = self.dataset[int(i)]
        start, stop = int(self._offsets[s][j]), int(self._offsets[s][j + 1])
        return {
            **{key: handle.get_slice(key)[start:stop] for key in self.keys},
            "base_argmax": handle.get_slice("base_argmax")[start:stop],
            "labels": torch.as_tensor(row["labels"], dtype=torch.long),
            "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
        }

    def __getstate__(self) -> dict[str, Any]:  # file handles do not pickle (DataLoader workers)
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"] = {}, {}
        return state


@dataclass
class HiddenCollator:
    """Right-pad cached rows into each feature ``[B, T, H]`` (``hidden`` for FINAL, ``layer<j>``; zero padding),
    ``base_argmax [B, T]``, ``labels [B, T]`` (-100 padding), ``input_ids [B, T]`` (0 padding) and
    ``attention_mask [B, T]``."""

    def __call__(self, features: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        width = max(int(f["base_argmax"].shape[0]) for f in features)
        B = len(features)
        padded = {key: torch.zeros(B, width, int(value.shape[1]), dtype=value.dtype)
                  for key, value in features[0].items() if key not in TOKEN_KEYS}
        argmax = torch.zeros(B, width, dtype=torch.long)
        labels = torch.full((B, width), -100, dtype=torch.long)
        input_ids = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)
        for b, f in enumerate(features):
            n = int(f["base_argmax"].shape[0])
            for key, value in padded.items():
                value[b, :n] = f[key]
            argmax[b, :n] = f["base_argmax"]
            labels[b, :n] = f["labels"]
            input_ids[b, :n] = f["input_ids"]
            mask[b, :n] = 1
        return {**padded, "base_argmax": argmax, "labels": labels, "input_ids": input_ids, "attention_mask": mask}
