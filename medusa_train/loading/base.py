"""One front door for base models: Hub id or local folder, GGUF file, or llama2.c checkpoint.

:func:`load_base_model` returns a ``*ForCausalLM`` in eval mode on the configured device and dtype, and its
tokenizer with the chat template kept. GGUF and llama2.c checkpoints are converted once into an ordinary HF folder
in ``model.converted_dtype`` under the cache (:mod:`medusa_train.loading.conversion_cache`: keyed by the source
files' sizes and modification times, and that dtype), so that later loads skip dequantization (about 20 s for
SmolLM2-135M on a 2-core CPU).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from medusa_train.config.schema import ModelConfig
from medusa_train.files.folders import publish_folder
from medusa_train.loading.conversion_cache import conversion_sources, converted_dir, gguf_location, llama2c_tokenizer
from medusa_train.config.precision import choose_dtype, parse_dtype

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``ValueError`` when CUDA is asked for and absent."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={device!r} but CUDA is not available here; use model.device=cpu or auto")
    return torch.device(device)


def detect_format(cfg: ModelConfig) -> str:
    """The checkpoint format: ``cfg.format`` unless ``auto``, then guessed from the path."""
    if cfg.format != "auto":
        return cfg.format
    path = Path(cfg.name_or_path)
    if cfg.gguf_file or path.suffix == ".gguf":
        return "gguf"
    if path.suffix == ".bin" and path.is_file():
        return "llama2c"
    return "hf"


def _save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write an HF folder under a temporary name and rename it into place (:func:`publish_folder`), so a killed run
    leaves no half folder; a concurrent rank that published it first keeps its copy."""

    def write(stage: Path) -> None:
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)

    publish_folder(target, write)


def _load_gguf(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The GGUF dequantized into ``cfg.converted_dtype``: transformers dequantizes each tensor in float32 and rounds
    it once into that dtype (the same bytes as rounding the float32 model: checked on both Qwen2.5-Coder GGUFs), so
    the peak memory is two copies of the model in that dtype (the loaded one is freed on return), not two in
    float32."""
    folder, name = gguf_location(cfg)
    dtype = parse_dtype(cfg.converted_dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    # A GGUF model loads dequantized but keeps its quantization settings, which make save_pretrained refuse:
    # rebuild it from a clean config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
    clean.load_state_dict(model.state_dict())
    return clean, tokenizer


def _load_llama2c(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from medusa_train.loading.llama2c import load_llama2c_model, load_llama2c_tokenizer

    model = load_llama2c_model(Path(cfg.name_or_path)).to(parse_dtype(cfg.converted_dtype))  # float32: itself
    return model, load_llama2c_tokenizer(llama2c_tokenizer(cfg))


def _converted(cfg: ModelConfig, fmt: str) -> str | tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """For GGUF/llama2c: the cached HF folder (converting first if needed), or the converted pair without caching."""
    sources = conversion_sources(cfg, fmt)
    convert = _load_gguf if fmt == "gguf" else _load_llama2c
    if not cfg.cache_converted:
        return convert(cfg)
    target = converted_dir(cfg, sources)
    if not (target / "config.json").is_file():
        log.info("converting %s checkpoint %s into %s (once)", fmt, sources[0], target)
        model, tokenizer = convert(cfg)
        _save_atomically(model, tokenizer, target)
    return str(target)


def engine_model_path(cfg: ModelConfig) -> str:
    """What another engine (vLLM, TGI) loads for this base model: ``name_or_path`` for an HF folder or Hub id; for a
    GGUF or llama2.c checkpoint, the HF folder it is converted into under the cache (converted now if needed,
    whatever ``cache_converted`` says).

    Raises:
        FileNotFoundError: a local checkpoint or tokenizer file is missing.
    """
    cfg.validate()
    fmt = detect_format(cfg)
    if fmt == "hf":
        return cfg.name_or_path
    path = _converted(dataclasses.replace(cfg, cache_converted=True), fmt)
    assert isinstance(path, str)
    return path


def base_weight_bytes(cfg: ModelConfig, device: torch.device) -> int:
    """Bytes of the base's weights in the dtype it would load in on ``device``, counted on a model built on the
    ``meta`` device from its config alone (no weights read); 0 when there is no HF config to read yet (a GGUF or
    llama2.c checkpoint not converted)."""
    from transformers import AutoConfig

    fmt = detect_format(cfg)
    source = cfg.name_or_path if fmt == "hf" else None
    if source is None:
        return 0
    config = AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    dtype = choose_dtype(cfg.dtype, device).dtype
    return sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8


def _needs_remote_code(folder: Path, error: Exception) -> bool:
    """Whether a failed load is for want of the model's own code: transformers says so, or a local folder's
    config.json maps Auto classes to its own files (``auto_map``)."""
    if "trust_remote_code" in str(error):
        return True
    try:
        return "auto_map" in json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _with_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer, its pad token set to EOS when it has none."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer_and_config(cfg: ModelConfig) -> tuple[PreTrainedTokenizerBase, Any]:
    """The base model's tokenizer (as :func:`load_base_model` returns it) and its HF config, without its weights: what
    work done before the base loads needs (self-distillation by vLLM or a server writes the replies first, so the
    training base is not on the GPU while the engines run). GGUF and llama2.c checkpoints are converted into the
    cache first (:func:`engine_model_path`).

    Raises:
        FileNotFoundError / OSError: as :func:`load_base_model`.
    """
    from transformers import AutoConfig

    path = engine_model_path(cfg)
    kwargs = dict(revision=cfg.revision if path == cfg.name_or_path else None, trust_remote_code=cfg.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise OSError(f"model: could not read the tokenizer and config of {cfg.name_or_path!r}: {e}") from e
    return _with_pad_token(tokenizer), config


def load_base_model(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the base causal LM and its tokenizer.

    Args:
        cfg: the ``model/`` config (validated here).

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``cfg.device`` in ``cfg.dtype`` (``auto`` resolved by
        :func:`medusa_train.config.precision.choose_dtype`); the tokenizer with its
        chat template, and a pad token (EOS when the tokenizer has none).

    Raises:
        ValueError: a bad setting (dtype, device, format), or float16 on a CPU.
        FileNotFoundError: a local checkpoint or tokenizer file is missing.
        OSError: transformers could not read the model (corrupt file, Hub id unreachable, custom code needed while
            ``cfg.trust_remote_code`` is off: the fix named); the cause is chained.
    """
    cfg.validate()
    device = resolve_device(cfg.device)
    dtype = choose_dtype(cfg.dtype, device).dtype  # resolves auto; refuses float16 on a CPU before loading
    fmt = detect_format(cfg)
    if fmt == "hf":
        source: str | tuple = cfg.name_or_path
        local = Path(cfg.name_or_path)
        if local.exists() and not (local / "config.json").is_file():
            raise FileNotFoundError(f"model: {local} has no config.json; is model.name_or_path a model folder?")
    else:
        source = _converted(cfg, fmt)
    if isinstance(source, tuple):
        model, tokenizer = source
        model = model.to(dtype=dtype)
    else:
        kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, attn_implementation=cfg.attn_implementation, **kwargs
            )
        except (OSError, ValueError) as e:
            if not cfg.trust_remote_code and _needs_remote_code(Path(cfg.name_or_path), e):
                raise OSError(
                    f"model: {cfg.name_or_path!r} needs its own Python code to load (auto_map in its config.json), "
                    "which runs only when you ask for it, never because a downloaded file says so: if you trust "
                    "that code, pass model.trust_remote_code=true (+model.trust_remote_code=true when no model= is "
                    "given; trust_remote_code=True in Python)") from e
            raise OSError(f"model: could not load {cfg.name_or_path!r} ({fmt}): {e}") from e
    if cfg.attn_implementation and fmt != "hf" and isinstance(source, tuple):
        model.set_attn_implementation(cfg.attn_implementation)
    _with_pad_token(tokenizer)
    model.eval()
    model.requires_grad_(False)
    return model.to(device), tokenizer
