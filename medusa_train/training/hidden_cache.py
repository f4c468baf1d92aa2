"""Hidden-state cache: run the frozen base once per sequence, then train the heads from disk for many epochs.

With the base frozen (Medusa-1), its features and greedy tokens never change, so they can be computed once.
:func:`build_hidden_cache` splits a tokenized dataset into blocks of :data:`BLOCK_ROWS` rows (fixed, not derived from
the world size: :mod:`medusa_train.runs.blocks`) dealt to ranks round-robin. Each block is one safetensors file
``{split}-block-{b:06d}.safetensors`` holding its rows' target features ``[T_i, H]`` each (base dtype; exactly the
ones the drafter reads, named as in :mod:`medusa_train.models.features`: the last hidden state :data:`FINAL` is stored, and
batched, as ``hidden``, a layer's under its name, e.g. ``layer3``) and base argmax tokens ``[T_i]``, next to its seal
``{split}-block-{b:06d}.json``: the features' names, the block's rows, a fingerprint of the data and the base
model's weights (:func:`base_weights_digest`: not its path, so a cache follows a moved checkout, and a base retrained
or requantized in place is not mistaken for the old one), and the file's size and sha256.

Memory: rows go to disk as each base forward pass makes them (:class:`~medusa_train.files.safetensors_stream.
SafetensorsStream`: the header is known from the rows' lengths before the base runs, so tensors are appended one
batch at a time and the sha256 is computed over the bytes as they go out). The builder holds one batch's features,
whatever the data size; a file is written to a temporary sibling and renamed into place
(:func:`medusa_train.files.atomic.atomic_write`), and its seal is written after it (a rebuilt block's old seal is removed
first), so a half-written block is never taken for a whole one.

Resume: a block whose seal matches (version, data fingerprint, rows, features) and whose file still has the sealed
size is reused; ``verify=True`` (what every training run passes) also checks each of this rank's blocks against its
seal's sha256 before the run first reads it, so a block damaged in place (same size) is rebuilt, never trained on: the
whole cache read once per run, over the ranks, hashed as it is read (parallel threads, one sequential read a block;
the pages it reads serve the training's first reads where memory holds them). It is not folded into the training's
own reads: those come in the sampler's order, a few rows at a time, and sha256 needs a file's bytes in order; and a
block found damaged there could not be rebuilt, since the base's backbone is released once the cache is built. One
built for other data is rebuilt, saying why; one written by another cache version or for other features, or a
damaged one, is rebuilt with a warning saying why. Since names hold the block index only, a run resumed on another
number of ranks reuses every finished block. A build stopped by SIGTERM or SIGUSR1 discards the block it was writing
and exits with 75 (:class:`CacheBuildStopped`); one killed outright leaves that block's temporary file, which the
next build removes (:func:`remove_temp_files`).

Disk: before any forward pass every rank checks that the cache folder's file system has room for the blocks still
to build (``tokens x (features x H x bytes(dtype) + 8)`` plus headers; EAGLE-3 stores three taps and FINAL): 1,000
conversations of 512 tokens with SmolLM2 (H=576, bf16) take 0.6 GB per feature; a 7B model (H=4096) on all of
ShareGPT would take terabytes, so the cache suits small data or many epochs. ``lockstep=True`` (a ZeRO-3
partitioned base, whose every forward pass all-gathers parameters on all ranks) makes every rank run as many
forward passes: ranks with fewer batches left run padding passes on a one-token batch whose outputs are discarded.

Reading: :class:`CachedHiddenDataset` checks every block's seal and size, then reads rows lazily through
``safe_open``, which memory-maps the file and copies out only the slice asked for. safetensors over a raw
``numpy.memmap`` or ``torch.from_file``: the file describes its own dtypes and shapes (numpy has no bfloat16, and a
raw file needs a layout of our own), it is the format the project already writes and checks, and other tools read
it. :class:`HiddenCollator` pads rows into batches; the Trainer's sampler sees the same rows in the same order as
without the cache. Every rank reads every block: ``output_dir`` (or ``hidden_cache_dir``) must be on a file system
all ranks share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from medusa_train.files.atomic import atomic_write, atomic_write_text, temp_files
from medusa_train.runs.blocks import block_count, block_rows, check_block_size, check_rank
from medusa_train.files.checksums import files_sha256
from medusa_train.runs.disk_space import DiskSpaceError, disk_full_named, require_free
from medusa_train.runs.drills import EXIT_AT_CACHE_BLOCK, exit_if_drilled
from medusa_train.data.collate import Collator
from medusa_train.models.features import FINAL, check_feature_layers, count_layers, feature_layer, target_features
from medusa_train.files.safetensors_stream import SafetensorsStream, TensorPlan, planned_size
from medusa_train.training.base_placement import gathered
from medusa_train.runs.preemption import PREEMPTED_EXIT_CODE, Stopped, stop_on_signals
from medusa_train.training.process_group import ranks_max
from medusa_train.training.step import FrozenBase, feature_key

log = logging.getLogger(__name__)

# 2: descriptions hold the shard's size and sha256; 3: the base is named by its weights' digest; 4: shards hold the
# named target features the drafter reads (descriptions list them); 5: world-size-independent blocks of BLOCK_ROWS
# rows, streamed to disk one batch at a time
CACHE_VERSION = 5
# Rows (conversations) per block file: fixed, so a resumed run on any number of ranks finds the same blocks. A block
# of 256 rows of 2,048 tokens holds 256 x 2,048 x H x 2 bytes per bf16 feature (8.6 GB for H=8,192).
BLOCK_ROWS = 256
# The per-token entries of a cached row that are not target features.
TOKEN_KEYS = ("base_argmax", "labels", "input_ids")
# Elements read from each base tensor for its digest (at an odd stride): a few MB for any model size.
DIGEST_SAMPLES = 4096
# Block files a reader keeps open (memory-mapped) at once; the least recently read is closed first.
OPEN_BLOCKS = 64


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


def block_name(split: str, block: int) -> str:
    """A block's file stem: ``{split}-block-{block:06d}`` (no world size in it)."""
    return f"{split}-block-{block:06d}"


def piece_key(key: str, piece: int) -> str:
    """The tensor name of batch ``piece``'s rows of ``key`` in a block file (``hidden.00003``)."""
    return f"{key}.{piece:05d}"


class CacheSpaceError(DiskSpaceError):
    """The cache folder's file system has less room than the blocks still to build need."""


@dataclass(frozen=True)
class BlockSeal:
    """The seal written next to a block (``<block>.json``), after the block."""

    fingerprint: str
    rows: list[int]  # [first, stop)
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
    """Why a block cannot be reused; ``warn``: its rebuild is worth a warning (not missing or built for other
    data, the ordinary cases)."""

    reason: str
    warn: bool = False


def _block_problem(folder: Path, name: str, fingerprint: str, rows: range,
                   features: Sequence[str]) -> ShardProblem | None:
    """None when the block can be reused, else why not: missing or unsealed, written by another cache version, built
    for other data or other features, or (checked by size; :func:`_verify_blocks` checks the sha256) changed since
    it was sealed."""
    meta_path, data_path = folder / f"{name}.json", folder / f"{name}.safetensors"
    if not (meta_path.is_file() and data_path.is_file()):
        return ShardProblem("missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return ShardProblem("its seal is unreadable", warn=True)
    if meta.get("version") != CACHE_VERSION:
        return ShardProblem(f"written by cache version {meta.get('version')} (this one is {CACHE_VERSION})",
                            warn=True)
    if not (meta.get("fingerprint") == fingerprint and meta.get("rows") == [rows.start, rows.stop]):
        return ShardProblem("built for other data (another dataset, base model or dtype)")
    if meta.get("features") != list(features):
        return ShardProblem(f"built for other target features ({meta.get('features')}, not {list(features)})",
                            warn=True)
    if data_path.stat().st_size != meta.get("size"):
        return ShardProblem(f"damaged: {data_path.stat().st_size} bytes, {meta.get('size')} when sealed", warn=True)
    return None


# why a block whose sha256 no longer matches its seal is rebuilt
SHA_MISMATCH = ShardProblem("damaged: its sha256 differs from the one sealed when it was written (same size)",
                            warn=True)


def _verify_blocks(folder: Path, names: Sequence[str]) -> dict[str, ShardProblem]:
    """The blocks among ``names`` (sealed, of their sealed size) whose file's sha256 differs from their seal's, each
    with :data:`SHA_MISMATCH`. Each file is read once, sequentially, and hashed as it is read
    (:func:`~medusa_train.files.checksums.files_sha256`: several files in parallel threads); the pages read stay in the
    page cache for the training's first reads where memory holds them. Logs the bytes and the time taken."""
    if not names:
        return {}
    paths = [folder / f"{name}.safetensors" for name in names]
    start = time.perf_counter()
    digests = files_sha256(paths)
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in paths)
    log.info("hidden cache: verified %d sealed blocks (%.2f GB) against their sha256 in %.1f s", len(paths),
             size / 1e9, seconds)
    return {name: SHA_MISMATCH for name, path in zip(names, paths)
            if digests[path] != json.loads((folder / f"{name}.json").read_text()).get("sha256")}


@dataclass(frozen=True)
class BlockPlan:
    """One block to build: its rows, their lengths (block order) and the base batches (positions in the block,
    longest rows first: batches of similar lengths waste less on padding; the file keeps the block's order through
    its ``index``)."""

    block: int
    rows: range
    lengths: list[int]
    batches: list[list[int]]

    def tensors(self, keys: Sequence[str], hidden_size: int, dtype: torch.dtype) -> list[TensorPlan]:
        """The file's tensors in write order: ``index [rows, 3]`` int64 (each row's batch, first and stop token in
        that batch's tensors), then per batch ``p`` each feature ``key.p [T_p, H]`` and ``base_argmax.p [T_p]``."""
        plan = [TensorPlan("index", torch.int64, (len(self.rows), 3))]
        for p, chunk in enumerate(self.batches):
            tokens = sum(self.lengths[j] for j in chunk)
            plan += [TensorPlan(piece_key(k, p), dtype, (tokens, hidden_size)) for k in keys]
            plan.append(TensorPlan(piece_key("base_argmax", p), torch.int64, (tokens,)))
        return plan

    def index(self) -> torch.Tensor:
        """``[rows, 3]`` int64: row j's (batch, first token, stop token) in that batch's tensors."""
        index = torch.zeros(len(self.rows), 3, dtype=torch.int64)
        for p, chunk in enumerate(self.batches):
            start = 0
            for j in chunk:
                index[j] = torch.tensor([p, start, start + self.lengths[j]])
                start += self.lengths[j]
        return index


def plan_block(dataset: Any, block: int, block_size: int, batch_size: int) -> BlockPlan:
    rows = block_rows(block, len(dataset), block_size)
    lengths = [len(dataset[i]["input_ids"]) for i in rows]
    order = sorted(range(len(rows)), key=lambda j: lengths[j], reverse=True)
    return BlockPlan(block, rows, lengths, [order[s : s + batch_size] for s in range(0, len(order), batch_size)])


# a block file or seal of split `split`, block `block` (what atomic_write's temporary files are named after)
BLOCK_FILE = re.compile(r"(?P<split>\w+)-block-(?P<block>\d{6})\.(safetensors|json)")


def remove_temp_files(folder: Path, split: str, rank: int, world_size: int) -> list[Path]:
    """Remove the temporary files that builds killed mid-write left in ``folder`` (``.{split}-block-NNNNNN.
    safetensors.tmp-PID``, and its seal's ``.json.tmp-PID``): of ``split`` only, and of the blocks this rank owns
    (``N % world_size == rank``: in this run no other rank writes those, so none is removed under a live writer; each
    left-over file has one owner, whatever the number of ranks that left it). Returns the files removed (logged with
    their bytes)."""
    removed = []
    for path, match in temp_files(folder, BLOCK_FILE):
        if match["split"] == split and int(match["block"]) % world_size == rank:
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            log.warning("hidden cache: removed %s (%d bytes), left by a build stopped while writing it", path, size)
            removed.append(path)
    return removed


class CacheBuildStopped(Stopped):
    """A stop signal (SIGTERM, SIGUSR1: a preemption) arrived while the cache was built: the block being written is
    discarded (its temporary file removed), every block sealed before it is kept, and the process exits with
    :data:`~medusa_train.runs.preemption.PREEMPTED_EXIT_CODE` (75), as a training run stopped by a signal does."""

    def __init__(self, signum: int, split: str) -> None:
        super().__init__(signum)
        self.split = split

    def __str__(self) -> str:
        return (f"stopped on {self.signal_name} while building the {self.split} blocks of the hidden cache; every "
                f"sealed block is kept: run the same command with resume=true to continue (exit code "
                f"{PREEMPTED_EXIT_CODE})")


# the ways out of a cache folder without room, in every message that says so
FULL_WAYS_OUT = ("free space there, point hidden_cache_dir at a larger shared disk, or train without the cache "
                 "(hidden_cache=false); a rerun reuses every sealed block")


def check_disk_space(folder: Path, needed: int, what: str) -> None:
    """Raises:
        CacheSpaceError: ``folder``'s file system has fewer than ``needed`` bytes free (both named, with ``what``
            they are for and the ways out)."""
    require_free(folder, needed, what, FULL_WAYS_OUT, error=CacheSpaceError, prefix="hidden cache: ")


def _base_forward(base: FrozenBase, batch: dict[str, torch.Tensor], layers: list[int],
                  device: torch.device | str, argmax_chunk_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One base pass: the named features ``[B, T, H]`` and the base argmax ``[B, T]``, ``argmax_chunk_size``
    positions projected onto the vocabulary at a time (the lm_head is replicated, not ZeRO-3-partitioned, so the
    number of projections may differ between ranks)."""
    named, _ = target_features(base.backbone, batch["input_ids"].to(device), layers,
                               attention_mask=batch["attention_mask"].to(device), use_cache=False)
    return named, base.argmax(named[FINAL], argmax_chunk_size)


def _write_block(path: Path, plan: BlockPlan, tensors: list[TensorPlan], run: Any, dataset: Any,
                 collator: Collator, features: Sequence[str], dtype: torch.dtype) -> str:
    """Stream one block to ``path`` (atomically); returns its sha256."""
    sealed: dict[str, str] = {}

    def write(tmp: Path) -> None:
        with SafetensorsStream(tmp, tensors) as out:
            out.write("index", plan.index())
            for p, chunk in enumerate(plan.batches):
                named, argmax = run(collator([dataset[plan.rows[j]] for j in chunk]))
                for f in features:
                    out.write(piece_key(feature_key(f), p), torch.cat(
                        [named[f][b, : plan.lengths[j]] for b, j in enumerate(chunk)]).to("cpu", dtype))
                out.write(piece_key("base_argmax", p), torch.cat(
                    [argmax[b, : plan.lengths[j]] for b, j in enumerate(chunk)]).to("cpu", torch.int64))
            sealed["sha256"] = out.close()

    atomic_write(path, write)
    return sealed["sha256"]


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
    block_size: int = BLOCK_ROWS,
    verify: bool = False,
    lockstep: bool = False,
    argmax_chunk_size: int = 0,
) -> list[Path]:
    """Write this rank's blocks of the cache for ``dataset`` (blocks ``rank, rank + world_size, ...`` of
    ``block_size`` rows), reusing every sealed one.

    Args:
        base: the frozen base with its backbone.
        dataset: rows with ``input_ids`` (and ``labels``), e.g. from ``build_dataset``.
        folder: the cache folder (created).
        split: ``train`` or ``eval``; part of the block files' names.
        fingerprint: :func:`dataset_fingerprint` of ``dataset``; a block sealed with it is reused.
        collator: pads token batches (right padding, ``attention_mask``).
        batch_size: rows per base forward pass (B).
        rank, world_size: this process's share.
        device: where the base runs.
        features: the target features to store (:mod:`medusa_train.models.features` names; the drafter's); a block
            written for other features is rebuilt.
        block_size: rows per block file (the same for every world size; readers must be given the same).
        verify: also check each of this rank's sealed blocks against its seal's sha256 before reusing it (reads each
            once, hashing as it reads: about 1.4 s per GB on a loaded core, ``docs/reliability.md``); one that differs
            is rebuilt with a warning naming it. Without it a block is checked by its seal and its size. The
            recipes pass True: every run checks every block it reuses.
        lockstep: every rank runs the same number of base forward passes (padding passes on a one-token batch,
            outputs discarded): needed when the base's parameters are partitioned by ZeRO-3. Collective: with it
            every rank must call this function.
        argmax_chunk_size: positions projected onto the base vocabulary at once for ``base_argmax`` (the recipes pass
            ``trainer.loss_chunk_size``): at most ``argmax_chunk_size x V`` logits live at a time instead of
            ``B x T x V`` (Llama-3.1's 128k vocabulary, B = 8, T = 4,096: 16.8 GB in fp32). 0: all at once.

    Returns:
        This rank's block files, in block order.

    Raises:
        ValueError: an empty, unknown or repeated feature name, a layer the base does not have, a bad rank,
            world size or block size.
        CacheSpaceError: the folder's file system has less room than the blocks still to build (by any rank) need;
            raised before any forward pass.
        DiskFullError: the disk filled anyway while a block was written (another writer, a file-size limit): the
            block and the bytes named; the block's temporary file is removed and it has no seal, so no reader takes
            it, and a rerun rebuilds it alone.
        CacheBuildStopped: SIGTERM or SIGUSR1 arrived while blocks were written (exit code 75): the block being
            written discarded, its temporary file removed. A build killed outright (``kill -9``) leaves its
            temporary file; the next build removes the ones of this rank's blocks before it starts
            (:func:`remove_temp_files`).
    """
    features = check_features(features)
    check_rank(rank, world_size)
    check_block_size(block_size)
    layers = [feature_layer(f) for f in features if f != FINAL]
    if layers:  # before any forward pass
        check_feature_layers(layers, count_layers(base.backbone.config), field="layers")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_temp_files(folder, split, rank, world_size)
    weight = base.lm_head.weight
    H = int(getattr(weight, "ds_shape", weight.shape)[1])  # ZeRO-3 keeps the full shape in ds_shape
    dtype = weight.dtype
    keys = [feature_key(f) for f in features]
    todo: list[tuple[BlockPlan, list[TensorPlan]]] = []
    mine: list[Path] = []
    needed = 0
    count = block_count(len(dataset), block_size)
    problems = {block_name(split, b): _block_problem(folder, block_name(split, b), fingerprint,
                                                     block_rows(b, len(dataset), block_size), features)
                for b in range(count)}
    if verify:  # this rank's blocks only: each block is hashed by one rank
        problems.update(_verify_blocks(folder, [block_name(split, b) for b in range(rank, count, world_size)
                                                if problems[block_name(split, b)] is None]))
    for b in range(count):
        ours = b % world_size == rank
        name = block_name(split, b)
        path = folder / f"{name}.safetensors"
        rows = block_rows(b, len(dataset), block_size)
        problem = problems[name]
        if ours:
            mine.append(path)
        if problem is None:
            if ours:
                log.info("hidden cache: reusing %s (%d rows)", path, len(rows))
            continue
        plan = plan_block(dataset, b, block_size, batch_size)
        tensors = plan.tensors(keys, H, dtype)
        needed += planned_size(tensors)  # every rank's missing blocks: the folder is shared
        if not ours:
            continue
        todo.append((plan, tensors))
        if problem.reason.startswith("damaged"):
            log.warning("hidden cache: %s is %s; rebuilding it", path, problem.reason)
        elif problem.reason != "missing":
            log.log(logging.WARNING if problem.warn else logging.INFO, "hidden cache: rebuilding %s (%s)", path,
                    problem.reason)
    check_disk_space(folder, needed, f"the {split} blocks still to build")
    passes = sum(len(plan.batches) for plan, _ in todo)
    padding = ranks_max(passes, device) - passes if lockstep else 0

    def run(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return _base_forward(base, batch, layers, device, argmax_chunk_size)

    with stop_on_signals(lambda signum: CacheBuildStopped(signum, split),  # the block being written discarded
                         "hidden cache: received %s; discarding the block being written, keeping the sealed ones"):
        left = sum(planned_size(tensors) for _, tensors in todo)  # this rank's bytes still to write
        for n, (plan, tensors) in enumerate(todo, start=1):
            exit_if_drilled(EXIT_AT_CACHE_BLOCK, n, rank)
            name = block_name(split, plan.block)
            path, seal_path = folder / f"{name}.safetensors", folder / f"{name}.json"
            seal_path.unlink(missing_ok=True)  # first: the block being rebuilt is never read under its old seal
            size = planned_size(tensors)
            what = f"hidden-cache block {plan.block} ({size:,} bytes) and this rank's {len(todo) - n} blocks after it"
            with disk_full_named(path, left, what, FULL_WAYS_OUT):
                sha256 = _write_block(path, plan, tensors, run, dataset, collator, features, dtype)
                seal = BlockSeal(fingerprint=fingerprint, rows=[plan.rows.start, plan.rows.stop], hidden_size=H,
                                 dtype=str(dtype), size=path.stat().st_size, sha256=sha256, features=list(features))
                atomic_write_text(seal_path, json.dumps(seal.to_json()))
            left -= size
            log.info("hidden cache: wrote %s (%d rows, %d tokens)", path, len(plan.rows), sum(plan.lengths))
        if padding:
            dummy = collator([{"input_ids": list(dataset[0]["input_ids"][:1]), "labels": [-100]}])
            for _ in range(padding):
                run(dummy)  # discarded: the other ranks' parameter all-gathers need this rank's pass
            log.info("hidden cache: %d padding forward passes (lockstep with the other ranks)", padding)
    return mine


class CachedHiddenDataset(torch.utils.data.Dataset):
    """Rows of a tokenized dataset with their cached target features, in the dataset's order.

    Item i: ``{"hidden": [T_i, H] (FINAL), "layer<j>": [T_i, H] (each other feature), "base_argmax": [T_i] long,
    "labels": [T_i] long, "input_ids": [T_i] long}`` (the token ids are the path Hydra heads read). Rows are copied
    out of the memory-mapped block files as they are asked for; at most :data:`OPEN_BLOCKS` files are open at once.

    Raises:
        ValueError: an empty, unknown or repeated feature name, or a bad ``block_size``.
        FileNotFoundError: a block is missing or unsealed, was written by another cache version, built for other data
            (fingerprint) or other ``features``, or has changed size since it was sealed (checked for every block
            before any is read; its owner rank checked more in :func:`build_hidden_cache`).
    """

    def __init__(
        self, dataset: Any, folder: str | os.PathLike[str], *, split: str, fingerprint: str,
        features: Sequence[str] = (FINAL,), block_size: int = BLOCK_ROWS,
    ) -> None:
        features = check_features(features)
        check_block_size(block_size)
        self.dataset = dataset
        self.keys = [feature_key(f) for f in features]
        self.folder = Path(folder)
        self.block_size = block_size
        self.names = [block_name(split, b) for b in range(block_count(len(dataset), block_size))]
        for b, name in enumerate(self.names):
            rows = block_rows(b, len(dataset), block_size)
            problem = _block_problem(self.folder, name, fingerprint, rows, features)
            if problem is not None:
                raise FileNotFoundError(
                    f"hidden cache block {self.folder / name}.safetensors is {problem.reason}; it is rebuilt at the "
                    "start of training (delete the folder to force it)"
                )
        self._handles: OrderedDict[int, tuple[Any, torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.dataset)

    def _open(self, b: int) -> tuple[Any, torch.Tensor]:
        """Block ``b``'s handle and ``index [rows, 3]``; opened lazily, so each DataLoader worker has its own."""
        if b in self._handles:
            self._handles.move_to_end(b)
            return self._handles[b]
        handle = safe_open(str(self.folder / f"{self.names[b]}.safetensors"), framework="pt")
        self._handles[b] = (handle, handle.get_tensor("index"))
        if len(self._handles) > OPEN_BLOCKS:
            self._handles.popitem(last=False)
        return self._handles[b]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        b, j = divmod(int(i), self.block_size)
        handle, index = self._open(b)
        piece, start, stop = (int(v) for v in index[j])
        row = self.dataset[int(i)]
        return {
            **{key: handle.get_slice(piece_key(key, piece))[start:stop] for key in self.keys},
            "base_argmax": handle.get_slice(piece_key("base_argmax", piece))[start:stop],
            "labels": torch.as_tensor(row["labels"], dtype=torch.long),
            "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
        }

    def __getstate__(self) -> dict[str, Any]:  # file handles do not pickle (DataLoader workers)
        state = dict(self.__dict__)
        state["_handles"] = OrderedDict()
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
