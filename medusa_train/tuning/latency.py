"""Verification latency: one target forward pass over n tree tokens on top of a KV cache, by n.

The tree's width is paid for in this latency (Medusa paper, Sec. 2.3.3; Sequoia, Sec. 4): on a GPU a pass over 64
tokens costs about what one does, on this CPU 2.7 times as much (NOTES.md). The profile is measured on the device and
dtype that will decode, and the tree size is chosen from it (:func:`medusa_train.tuning.search.best_tree_for_latency`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verification_latency(
    base: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = 256,
    repeats: int = 5,
    warmup: int = 2,
) -> dict:
    """Fastest wall time (ms) of one forward pass over ``n`` new tokens with a 4-D tree mask, for each n in ``sizes``.

    The sizes take turns within each repeat, so drift of the machine hits all alike, and the minimum over repeats is
    kept: interference from other work only ever adds time (the ``timeit`` convention).

    The pass matches the decoder's: backbone over n tokens after ``context_length`` cached ones, with an explicit
    ``[1, 1, n, context + n]`` additive mask (a chain's causal pattern: the cost of attention does not depend on the
    tree's shape), then the lm_head over the n positions.

    Returns:
        ``{"device": str, "dtype": str, "context_length": int, "repeats": int, "latency_ms": {n: float}}``.

    Raises:
        ValueError: a size below 1, or ``context_length + max(sizes)`` beyond the model's context.
    """
    if not sizes or min(sizes) < 1:
        raise ValueError(f"latency sizes must all be >= 1, got {list(sizes)}")
    limit = getattr(base.config, "max_position_embeddings", None)
    if limit is not None and context_length + max(sizes) > limit:
        raise ValueError(f"context_length + max size = {context_length + max(sizes)} exceeds the model's {limit}")
    device = base.get_output_embeddings().weight.device
    dtype = base.get_output_embeddings().weight.dtype
    vocab = base.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(3, vocab, (1, context_length), generator=gen).to(device)
    cache = DynamicCache(config=base.config)
    base.base_model(input_ids=context, cache=cache, use_cache=True)
    inputs = {}
    for n in sizes:
        tokens = torch.randint(3, vocab, (1, n), generator=gen).to(device)
        allowed = torch.ones(n, context_length + n, dtype=torch.bool, device=device)
        allowed[:, context_length:] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        mask = torch.zeros(1, 1, n, context_length + n, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        positions = torch.arange(context_length, context_length + n, device=device).unsqueeze(0)
        inputs[int(n)] = (tokens, mask, positions)
    times: dict[int, list[float]] = {n: [] for n in inputs}
    for r in range(warmup + repeats):
        for n, (tokens, mask, positions) in inputs.items():
            _sync(device)
            start = time.perf_counter()
            out = base.base_model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                                  cache=cache, use_cache=True)
            base.get_output_embeddings()(out.last_hidden_state)
            _sync(device)
            if r >= warmup:
                times[n].append((time.perf_counter() - start) * 1000.0)
            cache.crop(-n)
    results = {n: min(ts) for n, ts in times.items()}
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "context_length": context_length,
            "repeats": repeats, "latency_ms": results}


PROFILE_FILE = "latency_profile.json"


def read_latency_profile(export_dir: str | Path) -> dict:
    """The verification latency profile another tuning run wrote into ``export_dir`` (its ``latency_profile.json``),
    as :func:`measure_verification_latency` returns it (``latency_ms`` keyed by int).

    Raises:
        FileNotFoundError: no profile there.
        ValueError: not valid JSON, or without ``latency_ms``, ``device`` or ``dtype``.
    """
    path = Path(export_dir) / PROFILE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"latency_from={export_dir}: {path} not found; tune that export first")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"latency_from={export_dir}: {path} is not valid JSON: {e}") from e
    missing = [k for k in ("latency_ms", "device", "dtype") if k not in raw]
    if missing:
        raise ValueError(f"latency_from={export_dir}: {path} has no {missing}")
    profile = {k: raw[k] for k in ("device", "dtype", "context_length", "repeats") if k in raw}
    return {**profile, "latency_ms": {int(n): float(ms) for n, ms in raw["latency_ms"].items()}}


def check_profile_device(profile: dict, base: PreTrainedModel, source: str) -> None:
    """Refuse a profile measured on another device or dtype than ``base`` decodes on (both named)."""
    weight = base.get_output_embeddings().weight
    here = (str(weight.device), str(weight.dtype).replace("torch.", ""))
    if (profile["device"], profile["dtype"]) != here:
        raise ValueError(f"latency_from={source}: that profile was measured on {profile['device']} in "
                         f"{profile['dtype']}, but these heads decode on {here[0]} in {here[1]}; measure it here "
                         "(latency_from=null)")
