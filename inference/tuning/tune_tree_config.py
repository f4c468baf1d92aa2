"""Config schema of ``medusa-tune-tree`` (``conf/tune_tree.yaml``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from inference.tuning.latency import DEFAULT_SIZES
from medusa_train.config.bounds import MAX_COUNT, MAX_TOKENS, bound, check_bounds
from medusa_train.config.schema import check_device
from medusa_train.export.files import check_export_dir
from medusa_train.export.tree_files import read_latency_profile
from medusa_train.loading.cpu_kernels import DEFAULT_CPU_KERNELS, check_cpu_kernels
from medusa_train.config.precision import DEFAULT_DTYPE, check_dtype_name
from medusa_train.chat.prompts import check_prompt_set
from medusa_train.tree.buffers import TOPK


@dataclass
class PromptSetConfig:
    """A prompt set (see :func:`medusa_train.chat.prompts.load_prompts`)."""

    source: str = "sharegpt"
    path: Optional[str] = None
    offset: Optional[int] = field(default=None, metadata=bound(0, cap=MAX_COUNT))  # None: 0, or ShareGPT's held-out
    num_prompts: int = field(default=16, metadata=bound(1, cap=MAX_COUNT))


@dataclass
class TuneTreeConfig:
    """``medusa-tune-tree export_dir=DIR``: measure head accuracy and latency, search the tree, write it into DIR.

    Attributes:
        export_dir: the export folder; the results are written into it.
        model: optional ``model/`` config overriding the base recorded in the export.
        dtype: the decode-time dtype: ``auto`` (bf16 where the hardware multiplies bf16 natively, fp32 elsewhere:
            what ``medusa-eval`` decodes in by default), a dtype name, or None for the model config's. Latency is
            measured in it, so the tree fits the dtype that decodes.
        device: the decode-time device (default: the model config's).
        cpu_kernels: ``auto``, ``packed`` or ``none``: the linear kernels latency is measured on (as ``medusa-eval``).
        prompts: held-out prompts for the accuracy table.
        max_new_tokens: greedy continuation length per prompt.
        generation_batch_size: prompts continued per ``generate`` call (left-padded; 1 continues each prompt alone,
            exactly as the decoder would, at a fraction of the speed).
        topk: ranks measured per head (>= the widest rank a tree may use).
        max_nodes: largest tree considered (nodes, root excluded).
        latency_sizes: tree sizes (tokens incl. root) whose verification latency is measured.
        context_length: KV-cache length during the latency measurement.
        repeats: timed repeats per size (the fastest kept: timing noise only adds).
        latency_from: reuse the ``latency_profile.json`` of this export folder (made for the same base, measured on
            the same device and dtype) instead of measuring: trees for several exports of one base are then chosen
            against one profile, whose timing noise no longer differs between them (with ``timed_prompts=0``; else
            each export's size is chosen by its own timed decoding).
        timed_prompts: the first this many tuning prompts (all of them when there are fewer) are decoded with every
            tree predicted near the best (:mod:`inference.tuning.timed`), and the fastest measured is kept; 0
            keeps the predicted best.
        timed_new_tokens: tokens per reply in that timing.
        dynamic_depths, dynamic_topks, dynamic_totals: for drafters that grow an EAGLE-2 dynamic tree (EAGLE-3):
            the depths, topks and totals (nodes kept, root excluded) its shape is chosen from, by decoding the
            timed prompts with a shortlist of them (:mod:`inference.tuning.dynamic`); written to
            ``dynamic_tree.json``. ``dynamic_totals`` None: the latency profile's sizes less the root, up to
            ``max_nodes`` (:meth:`dynamic_tree_totals`). Unused for drafters that draft static trees only; the
            grid is checked once the drafter is known (:meth:`check_dynamic_grid`), before the accuracy pass.
        composite: also choose the composite tree's budget split (the heads' candidates and prompt lookup's in one
            tree, :mod:`inference.tuning.composite`) by decoding the timed prompts; written to
            ``composite_tree.json``, which medusa-eval's ``composite`` decoder reads.
        composite_heads: the heads' node counts tried beside the lookup drafts; None: half, once and twice the
            static tree kept.
        composite_lengths: lookup draft lengths tried (transformers' ``prompt_lookup_num_tokens``).
        composite_matches: distinct lookup drafts per step tried.
    """

    export_dir: str = MISSING
    model: Optional[Any] = None
    dtype: Optional[str] = DEFAULT_DTYPE
    device: Optional[str] = None
    cpu_kernels: str = DEFAULT_CPU_KERNELS
    prompts: PromptSetConfig = field(default_factory=PromptSetConfig)
    max_new_tokens: int = field(default=96, metadata=bound(4, cap=MAX_TOKENS, hint="at least 4 to measure the heads"))
    generation_batch_size: int = field(default=16, metadata=bound(1, cap=MAX_COUNT))
    topk: int = field(default=TOPK, metadata=bound(1, cap=MAX_COUNT))
    max_nodes: int = field(default=63, metadata=bound(1, cap=MAX_COUNT, hint="the tree node budget"))
    latency_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES[:9]),
                                     metadata=bound(1, cap=MAX_TOKENS, hint="tokens of a verification pass"))
    context_length: int = field(default=256, metadata=bound(1, cap=MAX_TOKENS))
    repeats: int = field(default=5, metadata=bound(1, cap=MAX_COUNT))
    latency_from: Optional[str] = None
    timed_prompts: int = field(default=4, metadata=bound(0, cap=MAX_COUNT, hint=(
        "tuning prompts decoded with each candidate tree; 0: keep the predicted best")))
    timed_new_tokens: int = field(default=64, metadata=bound(8, cap=MAX_TOKENS, hint="tokens per timed reply"))
    dynamic_depths: list[int] = field(default_factory=lambda: [3, 4, 5, 6], metadata=bound(
        1, cap=MAX_COUNT, hint="depths of a dynamic tree"))
    dynamic_topks: list[int] = field(default_factory=lambda: [4, 8], metadata=bound(
        1, cap=MAX_COUNT, hint="tokens drafted per expanded node of a dynamic tree"))
    dynamic_totals: Optional[list[int]] = field(default=None, metadata=bound(
        1, cap=MAX_COUNT, hint="nodes a dynamic tree keeps, root excluded"))

    composite: bool = True
    composite_heads: Optional[list[int]] = field(default=None, metadata=bound(
        1, cap=MAX_COUNT, hint="the heads' nodes of a composite tree"))
    composite_lengths: list[int] = field(default_factory=lambda: [4, 6, 10, 16], metadata=bound(
        1, cap=MAX_COUNT, hint="tokens of a lookup draft"))
    composite_matches: list[int] = field(default_factory=lambda: [1, 2], metadata=bound(
        1, cap=MAX_COUNT, hint="lookup drafts per step"))

    def validate(self) -> None:
        """Check every setting before any model is loaded.

        Raises:
            ValueError: a value out of range or a bad name (the key named); a ``latency_from`` profile that cannot
                be read.
            FileNotFoundError: ``export_dir`` is not an export (:func:`check_export_dir`); ``latency_from`` holds no
                ``latency_profile.json``; ``prompts.path`` does not exist.
            PermissionError: a file or folder of ``export_dir`` this user cannot read.
        """
        check_bounds(self)
        check_dtype_name(self.dtype)
        check_cpu_kernels(self.cpu_kernels)
        if self.device is not None:
            check_device(self.device, "device")
        if len(self.latency_sizes) < 2:
            raise ValueError(f"latency_sizes must hold at least two sizes >= 1, got {self.latency_sizes}")
        if self.context_length + max(self.latency_sizes) > MAX_TOKENS:
            raise ValueError(f"context_length + max(latency_sizes) = {self.context_length + max(self.latency_sizes)}"
                             f" exceeds the hard cap of {MAX_TOKENS} positions; lower context_length")
        for i, total in enumerate(self.dynamic_totals or ()):
            if total > self.max_nodes:
                raise ValueError(f"dynamic_totals[{i}] = {total} exceeds max_nodes={self.max_nodes} (the tree node "
                                 "budget): lower it or raise max_nodes")
        if self.composite:
            from inference.tuning.composite import composite_shortlist

            composite_shortlist(1, self.composite_heads, self.composite_lengths, self.composite_matches,
                                self.max_nodes)
        check_prompt_set(self.prompts.source, self.prompts.path, self.prompts.num_prompts)
        if self.latency_from is not None:
            read_latency_profile(self.latency_from)
        check_export_dir(self.export_dir)

    def check_dynamic_grid(self, profile_sizes: Iterable[int]) -> tuple[list[int], Any, list[Any]]:
        """The dynamic tree's grid for a latency profile of ``profile_sizes``: ``(totals, reference, shapes)``
        (:meth:`dynamic_tree_totals`, :func:`inference.tuning.dynamic.dynamic_shortlist`).

        Raises:
            ValueError: an empty list or a grid that holds no dynamic tree (the settings named).
        """
        from inference.tuning.dynamic import dynamic_shortlist

        totals = self.dynamic_tree_totals(profile_sizes)
        return (totals, *dynamic_shortlist(self.dynamic_depths, self.dynamic_topks, totals))

    def dynamic_tree_totals(self, profile_sizes: Iterable[int]) -> list[int]:
        """The totals a dynamic tree's shape is chosen from: ``dynamic_totals``, else the latency profile's sizes
        (tokens a pass) less the root, from 1 to ``max_nodes``, ascending.

        Raises:
            ValueError: ``dynamic_totals`` empty, or no profile size in that range (``latency_sizes`` and
                ``max_nodes`` named).
        """
        if self.dynamic_totals is not None:
            if not self.dynamic_totals:
                raise ValueError("dynamic_totals is empty: give at least one total, or null for the latency "
                                 "profile's sizes")
            return sorted(set(self.dynamic_totals))
        totals = sorted({n - 1 for n in profile_sizes if 1 <= n - 1 <= self.max_nodes})
        if not totals:
            raise ValueError(f"no latency_sizes between 2 and max_nodes + 1 = {self.max_nodes + 1}: a dynamic tree's "
                             "totals come from them; add such a size or set dynamic_totals")
        return totals

    def check_context(self, max_positions: Optional[int]) -> None:
        """Refuse lengths beyond the loaded model's context of ``max_positions`` tokens (None: unknown, no check),
        before the accuracy pass: ``context_length + max(latency_sizes)`` (the latency measurement's cache) and a
        one-token prompt plus ``max_new_tokens`` or ``timed_new_tokens`` must fit.

        Raises:
            ValueError: naming the setting and the largest value that fits.
        """
        if max_positions is None:
            return
        widest = max(self.latency_sizes)
        if self.context_length + widest > max_positions:
            fix = (f"set context_length to at most {max_positions - widest}" if widest < max_positions else
                   f"drop the latency_sizes of {max_positions} or more")
            raise ValueError(f"context_length={self.context_length} + max(latency_sizes)={widest} exceeds the model's "
                             f"context of {max_positions} positions: {fix}")
        for key in ("max_new_tokens", "timed_new_tokens"):
            if getattr(self, key) >= max_positions:
                raise ValueError(f"{key}={getattr(self, key)} does not fit the model's context of {max_positions} "
                                 f"positions (with a prompt of at least one token): set it to at most "
                                 f"{max_positions - 1}")


def check_settings(cfg: Any) -> TuneTreeConfig:
    """``cfg`` (``conf/tune_tree.yaml`` composed, without Hydra's node) as a validated :class:`TuneTreeConfig`:
    what ``medusa-tune-tree``'s Hydra callback checks before Hydra makes ``.tune_tree/`` inside the export.

    Raises:
        ValueError / FileNotFoundError / PermissionError: as :meth:`TuneTreeConfig.validate`.
    """
    from medusa_train.config.schema import as_dataclass

    return as_dataclass(TuneTreeConfig, cfg)


def register_tune_tree_schema() -> None:
    """Store :class:`TuneTreeConfig` as ``tune_tree_schema`` (``conf/tune_tree.yaml`` extends it; idempotent)."""
    ConfigStore.instance().store(name="tune_tree_schema", node=TuneTreeConfig)
