"""Where a GGUF or llama2.c checkpoint's HF conversion is cached, found without loading transformers: the files it
is converted from (checked to exist) and its folder, ``<cache>/converted/<stem>-<key>[-<dtype>]``.

The key is the sources' absolute paths, sizes and modification times (:func:`source_key`); a ``converted_dtype``
other than ``float32`` is appended, so each dtype has its own folder and a float32 conversion keeps the name it
always had. :mod:`medusa_train.loading.base` converts into it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from medusa_train.config.schema import ModelConfig
from medusa_train.files.paths import cache_dir
from medusa_train.config.precision import parse_dtype


def source_key(*files: Path) -> str:
    """A cache key (16 hex digits) from the files' absolute paths, sizes and modification times."""
    digest = hashlib.sha256()
    for f in files:
        st = f.stat()
        digest.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def gguf_location(cfg: ModelConfig) -> tuple[Path, str]:
    """``(folder, file name)`` of a GGUF model config's file (``name_or_path`` + ``gguf_file``, or a ``.gguf`` path).

    Raises:
        FileNotFoundError: no such file; the fields to check named.
    """
    path = Path(cfg.name_or_path)
    if cfg.gguf_file:
        folder, name = path, cfg.gguf_file
    else:
        folder, name = path.parent, path.name
    if not (folder / name).is_file():
        raise FileNotFoundError(f"model: GGUF file {folder / name} not found (check model.name_or_path / "
                                "model.gguf_file)")
    return folder, name


def llama2c_tokenizer(cfg: ModelConfig) -> Path:
    """A llama2.c config's tokenizer: ``tokenizer_path``, else ``tok512.bin`` beside the checkpoint."""
    checkpoint = Path(cfg.name_or_path)
    return Path(cfg.tokenizer_path) if cfg.tokenizer_path else checkpoint.with_name("tok512.bin")


def conversion_sources(cfg: ModelConfig, fmt: str) -> list[Path]:
    """The files a ``gguf`` or ``llama2c`` checkpoint is converted from (the checkpoint first).

    Raises:
        FileNotFoundError: one is missing; the field to check named.
    """
    if fmt == "gguf":
        folder, name = gguf_location(cfg)
        return [folder / name]
    checkpoint = Path(cfg.name_or_path)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"model: llama2.c checkpoint {checkpoint} not found (check model.name_or_path)")
    tok = llama2c_tokenizer(cfg)
    if not tok.is_file():
        raise FileNotFoundError(f"model: llama2.c tokenizer {tok} not found (set model.tokenizer_path)")
    return [checkpoint, tok]


def converted_dir(cfg: ModelConfig, sources: list[Path]) -> Path:
    """The cached HF folder of ``sources`` converted in ``cfg.converted_dtype`` (it may not exist yet)."""
    dtype = parse_dtype(cfg.converted_dtype)
    suffix = "" if dtype == torch.float32 else f"-{str(dtype).removeprefix('torch.')}"
    return cache_dir() / "converted" / f"{sources[0].stem}-{source_key(*sources)}{suffix}"


__all__ = ["conversion_sources", "converted_dir", "gguf_location", "llama2c_tokenizer", "source_key"]
