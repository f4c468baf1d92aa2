"""Verification latency: one target forward pass over n tree tokens on top of a KV cache, by n.

The tree's width is paid for in this latency (Medusa paper, Sec. 2.3.3; Sequoia, Sec. 4): on a GPU a pass over 64
tokens costs about what one does, on a 2-core CPU in fp32 2.7 times as much (``benchmarks/speed.py`` prints t(k)/t(1);
docs/speed.md has the figures). The profile is measured on the device and
dtype that will decode, and the tree sizes predicted best from it
(:func:`inference.tuning.search.best_tree_for_latency`) are then decoded for real (:mod:`inference.tuning.timed`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from medusa_train.tree.kv_cache import preallocated_cache

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PassTimer:
    """One model's verification pass, ready to be timed for several sizes n: ``n`` new tokens after
    ``context_length`` cached ones, with an explicit ``[1, 1, n, context + n]`` additive mask (a chain's causal
    pattern: the cost of attention does not depend on the tree's shape), then the lm_head over the n positions.

    Several timers (models, dtypes, kernels) can take turns, so drift of the machine hits all alike.

    Raises:
        ValueError: a size below 1, or ``context_length + max(sizes)`` beyond the model's context.
    """

    @torch.no_grad()
    def __init__(self, base: PreTrainedModel, sizes: Sequence[int], context_length: int = 256, seed: int = 0):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"latency sizes must all be >= 1, got {list(sizes)}")
        limit = getattr(base.config, "max_position_embeddings", None)
        if limit is not None and context_length + max(sizes) > limit:
            raise ValueError(f"context_length + max size = {context_length + max(sizes)} exceeds the model's {limit}")
        self.base = base
        self.context_length = context_length
        lm_head = base.get_output_embeddings()
        self.device, dtype, vocab = lm_head.weight.device, lm_head.weight.dtype, lm_head.weight.shape[0]
        self.dtype = dtype
        gen = torch.Generator().manual_seed(seed)
        context = torch.randint(3, vocab, (1, context_length), generator=gen).to(self.device)
        self.cache = preallocated_cache(context_length + max(sizes))  # the decoders' cache, written in place
        base.base_model(input_ids=context, cache=self.cache, use_cache=True)
        self.inputs: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        for n in sizes:
            tokens = torch.randint(3, vocab, (1, n), generator=gen).to(self.device)
            allowed = torch.ones(n, context_length + n, dtype=torch.bool, device=self.device)
            allowed[:, context_length:] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=self.device))
            mask = torch.zeros(1, 1, n, context_length + n, dtype=dtype, device=self.device)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            positions = torch.arange(context_length, context_length + n, device=self.device).unsqueeze(0)
            self.inputs[int(n)] = (tokens, mask, positions)

    @torch.no_grad()
    def time(self, n: int) -> float:
        """Seconds of one pass over ``n`` tokens (the cache is cropped back afterwards)."""
        tokens, mask, positions = self.inputs[n]
        _sync(self.device)
        start = time.perf_counter()
        out = self.base.base_model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                                   use_cache=True)
        self.base.get_output_embeddings()(out.last_hidden_state)
        _sync(self.device)
        elapsed = time.perf_counter() - start
        self.cache.crop(-n)
        return elapsed


@torch.no_grad()
def measure_verification_latency(
    base: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    context_length: int = 256,
    repeats: int = 5,
    warmup: int = 2,
) -> dict:
    """Fastest wall time (ms) of one forward pass over ``n`` new tokens with a 4-D tree mask, for each n in ``sizes``
    (:class:`PassTimer`).

    The sizes take turns within each repeat, so drift of the machine hits all alike, and the minimum over repeats is
    kept: interference from other work only ever adds time (the ``timeit`` convention).

    Returns:
        ``{"device": str, "dtype": str, "context_length": int, "repeats": int, "latency_ms": {n: float}}``.

    Raises:
        ValueError: a size below 1, or ``context_length + max(sizes)`` beyond the model's context.
    """
    timer = PassTimer(base, sizes, context_length)
    times: dict[int, list[float]] = {n: [] for n in timer.inputs}
    for r in range(warmup + repeats):
        for n in timer.inputs:
            elapsed = timer.time(n)
            if r >= warmup:
                times[n].append(elapsed * 1000.0)
    results = {n: min(ts) for n, ts in times.items()}
    return {"device": str(timer.device), "dtype": str(timer.dtype).replace("torch.", ""),
            "context_length": context_length, "repeats": repeats, "latency_ms": results}


def check_profile_runtime(profile: dict, base: PreTrainedModel, source: str, kernels: str | None = None) -> None:
    """Refuse a profile measured on another device, dtype or linear kernels than ``base`` decodes on (each named).

    Args:
        profile: a ``latency_profile.json`` (:func:`~medusa_train.export.tree_files.read_latency_profile`).
        base: the model the tree will decode on.
        source: the export folder the profile came from (named in the error).
        kernels: the kernels ``base`` runs on (``cpu_kernels.kernels`` of the runtime record, e.g.
            ``onednn_packed``); None, or a profile that records none, skips that comparison.

    Raises:
        ValueError: device, dtype or kernels differ: a tree tuned on another cost curve is not this machine's best.
    """
    weight = base.get_output_embeddings().weight
    here = (str(weight.device), str(weight.dtype).replace("torch.", ""))
    if (profile["device"], profile["dtype"]) != here:
        raise ValueError(f"latency_from={source}: that profile was measured on {profile['device']} in "
                         f"{profile['dtype']}, but these heads decode on {here[0]} in {here[1]}; measure it here "
                         "(latency_from=null)")
    measured = (profile.get("cpu_kernels") or {}).get("kernels")
    if kernels is not None and measured is not None and measured != kernels:
        raise ValueError(f"latency_from={source}: that profile was measured on {measured} linear kernels, but these "
                         f"heads decode on {kernels}; measure it here (latency_from=null) or load with the same "
                         "cpu_kernels")
