"""Decoders by name: each entry pairs a settings dataclass (the ``decoder/<name>.yaml`` schema) with a builder.

Adding a decoder is one :class:`DecoderEntry` in :data:`REGISTRY`: its settings are checked (unknown keys, bad values,
missing required settings) by :func:`decoder_settings` before any model is loaded, and :func:`build_decoder` turns
them into a :class:`~inference.decoders.base.Decoder` over the already loaded target model. A drafter type's engine
decoders (``vllm_medusa``, ``vllm_eagle3``, ``llamacpp_eagle3``) are its own: declared with their settings in its folder
(:attr:`~medusa_train.models.catalog.DrafterType.engine_decoders`) and registered here by :func:`sync_drafter_decoders`, built
by the engine's builder; this module names no drafter type.

Names: ``vanilla``, ``tree`` (``medusa``: its old name, :mod:`medusa_train.config.renames`), ``composite``, ``draft``,
``lookahead``, ``hf_assisted``, ``hf_prompt_lookup``, and the real engines ``vllm`` / ``vllm_medusa`` / ``vllm_eagle3``
/ ``vllm_draft`` / ``vllm_ngram`` and ``llamacpp`` / ``llamacpp_eagle3`` / ``llamacpp_draft`` / ``llamacpp_ngram``. The
vLLM decoders run in vLLM's own environment (``bash launch/install_vllm.sh``), the llama.cpp ones in its
``llama-server`` (``bash launch/install_llamacpp.sh``), and only when listed in ``decoders``: they are left out of the
default list.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from inference.decoders.base import DecodeConfig, Decoder
from inference.decoders.tree import ACCEPTANCE, POSTERIOR_ALPHA, POSTERIOR_THRESHOLD, check_acceptance
from inference.draft_loading import DraftConfig
from medusa_train.config.bounds import MAX_COUNT, bound, check_bounds
from medusa_train.models.catalog import drafter_types
from medusa_train.engines.settings import LlamaCppSettings, VllmSettings
from medusa_train.config.renames import decoder_alias
from medusa_train.tree.buffers import TOPK
from medusa_train.tree.composite import LOOKUP_LENGTH, MAX_MATCHING_NGRAM_SIZE


BASELINE = "vanilla"  # plain decoding in our decoder: every run's first decoder, the reference of speedup
ENGINES = ("ours", "vllm", "llamacpp")  # where a decoder runs: our PyTorch decoders, vLLM, llama.cpp's llama-server


@dataclass
class BuildContext:
    """What builders get besides their settings: the loaded target model and where it came from.

    Attributes:
        model: the :class:`~medusa_train.models.speculative.SpeculativeModel` (``.base`` is the target ``*ForCausalLM``).
        tokenizer: the target's tokenizer.
        export_dir: the export folder (tuned tree files live there).
        dtype, device: the run's dtype and device overrides (None: the model config's); a second model (a draft)
            is loaded with them too.
        kernels: the target's linear kernels (:class:`~medusa_train.loading.cpu_kernels.KernelChoice`); a second
            model is converted the same way, so drafting runs on the kernels verification runs on. None: as loaded.
        drafts: drafts built so far, by settings, so that decoders sharing a draft load it once.
        model_config: the target's resolved ``model/`` config (:class:`~medusa_train.config.schema.ModelConfig`), for
            engines that load the target themselves (vLLM); None where the caller has none.
    """

    model: Any
    tokenizer: Any
    export_dir: str
    dtype: Optional[str] = None
    device: Optional[str] = None
    kernels: Optional[Any] = None
    drafts: dict[str, Any] = field(default_factory=dict)
    model_config: Optional[Any] = None


@dataclass
class BuiltDecoder:
    """A decoder and what was resolved while building it (e.g. the tree used and where it came from), for the run
    record."""

    decoder: Decoder
    info: dict[str, Any] = field(default_factory=dict)


# --- settings -------------------------------------------------------------------------------------------------


@dataclass
class VanillaSettings:
    """Plain decoding (:class:`~inference.decoders.vanilla.VanillaDecoder`).

    Attributes:
        record_top2_gaps: record each token's top-2 logit gap (computed after the clock stops: the timing is plain
            decoding's), against which other decoders' divergences from vanilla's replies are explained.
    """

    record_top2_gaps: bool = True

    def validate(self) -> None:
        return None


@dataclass
class TreeSettings:
    """Tree decoding with the export's drafter (:class:`~inference.decoders.tree.TreeDecoder`), whatever its type
    (the export's ``head_type``; the run record names it): Medusa heads, Hydra heads drafting level by level, an
    EAGLE-3 drafter.

    Attributes:
        acceptance: ``greedy``, ``typical`` or ``speculative`` (typical and speculative are greedy at temperature 0).
        posterior_threshold, posterior_alpha: typical acceptance's epsilon and delta (Medusa paper, Sec. 2.3.1).
        topk: candidates taken from each head.
        medusa_choices: the tree (a list of paths, or a JSON file holding one); None: the export's
            ``medusa_choices.json`` when present, else Medusa's default tree cut to the heads and ``topk``.
        dynamic_tree: an EAGLE-2 dynamic tree grown every step by drafters that grow one (EAGLE-3):
            ``{depth, topk, total}`` (:class:`medusa_train.tree.dynamic.DynamicTree`), e.g.
            ``decoder.tree.dynamic_tree={depth:5,topk:8,total:48}``; ``medusa_choices`` and ``topk`` are then
            unused. None: for such drafters the export's ``dynamic_tree.json`` (``medusa-tune-tree``) when present
            and ``medusa_choices`` is not set, else the static tree above (the run record's ``tree_source`` says
            which).
    """

    acceptance: str = ACCEPTANCE
    # the ranges of medusa_train.tree.acceptance.check_posterior (typical acceptance's epsilon and delta)
    posterior_threshold: float = field(default=POSTERIOR_THRESHOLD, metadata=bound(0, 1, low_open=True))
    posterior_alpha: float = field(default=POSTERIOR_ALPHA, metadata=bound(0, low_open=True))
    topk: int = field(default=TOPK, metadata=bound(1, cap=MAX_COUNT))
    medusa_choices: Optional[Any] = None
    dynamic_tree: Optional[Any] = None

    def validate(self) -> None:
        from medusa_train.tree.dynamic import dynamic_tree

        check_acceptance(self.acceptance, DecodeConfig(max_new_tokens=1), "acceptance")
        dynamic_tree(self.dynamic_tree)


@dataclass
class CompositeSettings(TreeSettings):
    """The composite tree decoder (:class:`~inference.decoders.tree.TreeDecoder` with ``composite``): every step's
    tree merges the export's heads' candidates with prompt lookup's drafts of the prompt and the reply so far, within
    a node budget, verified in one pass (:mod:`inference.proposers.composite`). The fields of
    :class:`TreeSettings` (the heads' tree: ``medusa_choices`` None takes ``composite_tree.json``'s, the heads'
    best tree of the whole budget), and the budget split; each None takes the export's ``composite_tree.json``
    (``medusa-tune-tree``), else the default:

    Attributes:
        nodes: the node budget of a step (root excluded); default: the heads' tree's nodes plus the lookup drafts'.
        lookup_length: tokens per lookup draft; default transformers' 10.
        lookup_matches: distinct lookup drafts per step; default 1.
        max_matching_ngram_size: the longest n-gram matched; default transformers' 2.
    """

    nodes: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT, hint="the node budget of a step"))
    lookup_length: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT,
                                                                      hint="tokens per lookup draft"))
    lookup_matches: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT,
                                                                       hint="lookup drafts per step"))
    max_matching_ngram_size: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))

    def validate(self) -> None:
        from medusa_train.tree.composite import setting_split

        super().validate()
        if self.nodes is not None:  # against the lookup fields set; the rest once the export's split is read
            setting_split(nodes=self.nodes, lookup_length=self.lookup_length or 1,
                          lookup_matches=self.lookup_matches or 1)


@dataclass
class DraftSettings(DraftConfig):
    """Speculative decoding with a draft model (:class:`~inference.decoders.draft.DraftDecoder`); the fields of
    :class:`inference.draft_loading.DraftConfig`: ``kind`` (``self_layers``: the target's first ``num_layers``
    layers; ``model``: a separate ``model/`` config under ``model``, loaded in the run's dtype and device),
    ``num_draft_tokens`` (K) and ``schedule``, and:

    Attributes:
        confidence_threshold: stop drafting after a token the draft gave less probability than this (transformers'
            ``assistant_confidence_threshold``, whose default is 0.4; :class:`HfAssistedSettings`); 0: always draft
            K tokens.
    """

    confidence_threshold: float = field(default=0.0, metadata=bound(0, 1, high_open=True))


@dataclass
class HfAssistedSettings(DraftConfig):
    """``generate(assistant_model=...)`` (:class:`~inference.decoders.hf_peers.HfAssistedDecoder`): the draft as in
    :class:`DraftSettings`, and ``confidence_threshold``, transformers' ``assistant_confidence_threshold`` (None: the
    draft's generation config value; 0: always draft K tokens, as the draft decoder does)."""

    confidence_threshold: Optional[float] = field(default=None, metadata=bound(0, 1))


@dataclass
class LookaheadSettings:
    """Lookahead decoding (:class:`~inference.decoders.lookahead.LookaheadDecoder`), greedy only.

    Attributes:
        window: W, positions ahead per Jacobi iteration.
        ngram: N, the n-gram size.
        guesses: G, candidate n-grams verified per step.
        prompt_ngrams: also pool the prompt's own n-grams.
    """

    # the ranges of inference.proposers.lookahead.check_lookahead_settings, capped
    window: int = field(default=5, metadata=bound(1, cap=MAX_COUNT, hint="W, lookahead window size"))
    ngram: int = field(default=4, metadata=bound(2, cap=MAX_COUNT, hint="N, n-gram size"))
    guesses: int = field(default=5, metadata=bound(1, cap=MAX_COUNT, hint="G, candidate n-grams verified per step"))
    prompt_ngrams: bool = True

    def validate(self) -> None:
        return None


@dataclass
class HfPromptLookupSettings:
    """``generate(prompt_lookup_num_tokens=...)`` (:class:`~inference.decoders.hf_peers.HfPromptLookupDecoder`),
    greedy only.

    Attributes:
        num_draft_tokens: K, tokens copied from the prompt per match (``prompt_lookup_num_tokens``).
        max_matching_ngram_size: longest n-gram matched against the prompt.
    """

    num_draft_tokens: int = field(default=LOOKUP_LENGTH, metadata=bound(1, cap=MAX_COUNT))
    max_matching_ngram_size: int = field(default=MAX_MATCHING_NGRAM_SIZE, metadata=bound(1, cap=MAX_COUNT))

    def validate(self) -> None:
        return None


@dataclass
class VllmDraftSettings(VllmSettings):
    """vLLM's draft-model speculation (``speculative_config={"method": "draft_model", "model": DRAFT, ...}``;
    :class:`~inference.decoders.vllm.VllmDecoder`): a separate draft model with the target's tokenizer proposes a
    chain of K tokens, the target verifies it in one pass. The fields of :class:`VllmSettings`, and:

    Attributes:
        num_speculative_tokens: K, tokens the draft proposes per step.
        model: the draft's ``model/`` config (an HF folder, or a GGUF vLLM loads through its converted HF folder);
            None: the run's ``draft=`` (:func:`with_run_draft`), which medusa-eval then requires.
    """

    num_speculative_tokens: int = field(default=3, metadata=bound(1, cap=MAX_COUNT, hint="K, drafted tokens"))
    model: Optional[Any] = None
    method: ClassVar[str] = "draft_model"


@dataclass
class VllmNgramSettings(VllmSettings):
    """vLLM's n-gram (prompt lookup) speculation (``speculative_config={"method": "ngram", ...}``;
    :class:`~inference.decoders.vllm.VllmDecoder`): the last n tokens (n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``) are matched in the prompt and the reply so far and the K tokens that followed are proposed;
    no draft model. The fields of :class:`VllmSettings`, and:

    Attributes:
        num_speculative_tokens: K, tokens proposed per step.
        prompt_lookup_max, prompt_lookup_min: the longest and shortest n-gram matched.
    """

    num_speculative_tokens: int = field(default=5, metadata=bound(1, cap=MAX_COUNT, hint="K, proposed tokens"))
    prompt_lookup_max: int = field(default=4, metadata=bound(1, cap=MAX_COUNT))
    prompt_lookup_min: int = field(default=2, metadata=bound(1, cap=MAX_COUNT))
    method: ClassVar[str] = "ngram"

    def validate(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max="
                             f"{self.prompt_lookup_max}")


@dataclass
class LlamaCppDraftSettings(LlamaCppSettings):
    """llama.cpp's draft-model speculative decoding (``--spec-type draft-simple -md DRAFT``;
    :class:`~inference.decoders.llamacpp.LlamaCppDecoder`): a separate draft GGUF with the target's vocabulary
    drafts a chain of at most ``draft_max`` tokens, cut where its top-1 probability falls below ``draft_p_min``; the
    target verifies it in one pass. The fields of :class:`LlamaCppSettings`, and:

    Attributes:
        draft_max: the longest drafted chain (``--spec-draft-n-max``).
        draft_p_min: the draft's top-1 probability below which it stops drafting (``--spec-draft-p-min``).
        model: the draft's ``model/`` config (a GGUF: ``name_or_path/gguf_file``, loaded as stored); None: the
            run's ``draft=`` (:func:`with_run_draft`), which medusa-eval then requires.
    """

    draft_max: int = field(default=3, metadata=bound(1, cap=MAX_COUNT, hint="the longest drafted chain"))
    draft_p_min: float = field(default=0.5, metadata=bound(0, 1))
    model: Optional[Any] = None
    spec_type: ClassVar[str] = "draft-simple"


@dataclass
class LlamaCppNgramSettings(LlamaCppSettings):
    """llama.cpp's n-gram self-speculation (``--spec-type ngram-simple``; no draft model): the last ``ngram_size``
    tokens are looked up in the prompt and the reply so far and the ``draft_max`` tokens that followed their latest
    earlier occurrence are proposed, verified in one pass. The fields of :class:`LlamaCppSettings`, and:

    Attributes:
        ngram_size: n, the n-gram looked up (``--spec-ngram-simple-size-n``; llama.cpp's default 12).
        draft_max: m, the tokens proposed after a match (``--spec-ngram-simple-size-m``; llama.cpp's default 48).
    """

    ngram_size: int = field(default=3, metadata=bound(1, cap=1024, hint="n, the n-gram looked up"))
    draft_max: int = field(default=8, metadata=bound(1, cap=1024, hint="m, tokens proposed after a match"))
    spec_type: ClassVar[str] = "ngram-simple"


# --- request checks (run before any model loads) ---------------------------------------------------------------


def _greedy_only(name: str) -> Callable[[Any, DecodeConfig], None]:
    def check(settings: Any, request: DecodeConfig) -> None:
        if not request.greedy:
            raise ValueError(f"decoder {name!r} decodes greedily only: set temperature=0 or leave {name} out of "
                             "decoders")
    return check


def _check_tree_request(name: str) -> Callable[[TreeSettings, DecodeConfig], None]:
    def check(settings: TreeSettings, request: DecodeConfig) -> None:
        check_acceptance(settings.acceptance, request, f"decoder.{name}.acceptance")
    return check


def _check_vllm_request(settings: VllmSettings, request: DecodeConfig) -> None:
    from medusa_train.engines.vllm_env import vllm_python

    if request.stop_strings:
        raise ValueError("the vllm decoders take token ids only: stop_strings are not supported")
    vllm_python()  # VllmUnavailable naming `bash launch/install_vllm.sh` when the environment is missing


def _check_llamacpp_request(settings: LlamaCppSettings, request: DecodeConfig) -> None:
    from medusa_train.engines.llamacpp_env import llamacpp_binary

    if not request.greedy:
        raise ValueError("the llamacpp decoders decode greedily only: set temperature=0 or leave them out of decoders")
    if request.stop_strings:
        raise ValueError("the llamacpp decoders take token ids only: stop_strings are not supported")
    llamacpp_binary("llama-server")  # LlamaCppUnavailable naming `bash launch/install_llamacpp.sh` when missing


def _needs_draft_model(check: Callable[[Any, DecodeConfig], None], name: str) -> Callable[[Any, DecodeConfig], None]:
    """Refuse settings that name no draft model (``decoder.<name>.model`` and ``draft=`` named), then ``check``."""
    def checked(settings: Any, request: DecodeConfig) -> None:
        if settings.model is None:
            raise ValueError(f"decoder.{name}.model: {name} drafts with a separate model and none is given: pass "
                             f"draft=<draft preset> (e.g. draft=qwen2_5_coder_0_5b) or decoder.{name}.model=...")
        check(settings, request)
    return checked


# --- builders -------------------------------------------------------------------------------------------------


def _build_vanilla(settings: VanillaSettings, ctx: BuildContext) -> BuiltDecoder:
    from inference.decoders.vanilla import VanillaDecoder

    return BuiltDecoder(VanillaDecoder(ctx.model.base, tokenizer=ctx.tokenizer,
                                       record_top2_gaps=settings.record_top2_gaps))


def _build_tree(settings: TreeSettings, ctx: BuildContext, name: str = "tree") -> BuiltDecoder:
    from inference.decoders.choices import resolve_dynamic_tree
    from inference.decoders.tree import TreeDecoder
    from medusa_train.export.tree_files import DYNAMIC_TREE_FILE, read_tree_files

    shape, source = resolve_dynamic_tree(settings.dynamic_tree, settings.medusa_choices, ctx.export_dir, ctx.model,
                                         f"decoder.{name}.dynamic_tree")
    if shape is not None:
        if settings.dynamic_tree is None:
            _check_tuned_for(read_tree_files(ctx.export_dir).get("latency_profile"), ctx, DYNAMIC_TREE_FILE)
        decoder = TreeDecoder(ctx.model, None, acceptance=settings.acceptance, dynamic_tree=shape,
                              posterior_threshold=settings.posterior_threshold,
                              posterior_alpha=settings.posterior_alpha, tokenizer=ctx.tokenizer)
        decoder.name = name
        return BuiltDecoder(decoder, {"head_type": ctx.model.head_type, "tree_source": source,
                                      "dynamic_tree": decoder.dynamic_tree.as_dict(),
                                      "tree_nodes": decoder.dynamic_tree.num_nodes})
    choices, source = _static_tree(settings, ctx, settings.medusa_choices, f"decoder.{name}.medusa_choices")
    decoder = TreeDecoder(ctx.model, choices, topk=settings.topk, acceptance=settings.acceptance,
                          posterior_threshold=settings.posterior_threshold,
                          posterior_alpha=settings.posterior_alpha, tokenizer=ctx.tokenizer)
    decoder.name = name
    return BuiltDecoder(decoder, {"head_type": ctx.model.head_type, "medusa_choices": [list(p) for p in choices],
                                  "tree_source": source, "tree_nodes": len(choices) + 1})


def _build_old_tree(settings: TreeSettings, ctx: BuildContext) -> BuiltDecoder:
    """``tree`` under its old name, ``medusa``: its rows keep that name."""
    return _build_tree(settings, ctx, "medusa")


def _static_tree(settings: TreeSettings, ctx: BuildContext, choices: Any, key: str) -> tuple[list, str]:
    """The static tree a tree decoder takes and where it came from: ``choices`` (the setting ``key``), else the
    export's ``medusa_choices.json`` (warned when tuned on other latency), else Medusa's default tree."""
    from inference.decoders.choices import resolve_medusa_choices
    from medusa_train.export.tree_files import CHOICES_FILE, read_tree_files

    resolved = resolve_medusa_choices(choices, ctx.export_dir, ctx.model.heads.spec.num_heads, settings.topk)
    tuned = read_tree_files(ctx.export_dir)
    if choices is not None:
        return resolved, key
    if "medusa_choices" in tuned:
        _check_tuned_for(tuned.get("latency_profile"), ctx, CHOICES_FILE)
        return resolved, "export medusa_choices.json"
    return resolved, "default tree (mc_sim_7b_63 cut to the heads and topk)"


def _build_composite(settings: CompositeSettings, ctx: BuildContext) -> BuiltDecoder:
    from inference.decoders.choices import resolve_composite
    from inference.decoders.tree import TreeDecoder
    from medusa_train.tree.dynamic import dynamic_tree
    from medusa_train.tree.buffers import validate_medusa_choices
    from medusa_train.export.tree_files import COMPOSITE_FILE, read_tree_files

    spec = ctx.model.heads.spec
    files = read_tree_files(ctx.export_dir, spec.num_heads, spec.out_size)
    tuned = files.get("composite_tree")
    if tuned is not None and settings.medusa_choices is None and settings.dynamic_tree is None:
        _check_tuned_for(files.get("latency_profile"), ctx, COMPOSITE_FILE)
        choices, tree_source = tuned["medusa_choices"], f"export {COMPOSITE_FILE}"
    elif settings.dynamic_tree is not None:
        choices, tree_source = None, "decoder.composite.dynamic_tree"
    else:
        choices, tree_source = _static_tree(settings, ctx, settings.medusa_choices, "decoder.composite.medusa_choices")
    if choices is not None:  # the tree's own ranks may exceed settings.topk (a tuned tree of the whole budget)
        validate_medusa_choices(choices, spec.num_heads, spec.out_size)
    heads_nodes = dynamic_tree(settings.dynamic_tree).total if choices is None else len(choices)
    composite, source = resolve_composite(settings, tuned, heads_nodes)
    topk = max(settings.topk, 1 + max(max(p) for p in choices)) if choices is not None else settings.topk
    decoder = TreeDecoder(ctx.model, choices, topk=min(topk, spec.out_size),
                          acceptance=settings.acceptance, posterior_threshold=settings.posterior_threshold,
                          posterior_alpha=settings.posterior_alpha, tokenizer=ctx.tokenizer,
                          dynamic_tree=settings.dynamic_tree, composite=composite)
    decoder.name = "composite"
    info = {"head_type": ctx.model.head_type, "tree_source": tree_source, "composite": composite.as_dict(),
            "composite_source": source, "tree_nodes": decoder.tree.num_nodes}
    if choices is not None:
        info["medusa_choices"] = [list(p) for p in choices]
    return BuiltDecoder(decoder, info)


def _check_tuned_for(profile: Optional[dict[str, Any]], ctx: BuildContext, tuned_file: str) -> None:
    """Warn when the export's tree (``tuned_file``) was tuned on the latency of another dtype or other kernels than
    this run's: the best tree size follows the cost of a k-token pass, which both change."""
    if not profile:
        return
    tuned = {"dtype": profile.get("dtype"), "kernels": (profile.get("cpu_kernels") or {}).get("kernels")}
    now = {"dtype": ctx.dtype, "kernels": ctx.kernels.kernels if ctx.kernels is not None else None}
    differ = [f"{key} {tuned[key]} (tuned) vs {now[key]} (this run)" for key in tuned
              if tuned[key] is not None and now[key] is not None and tuned[key] != now[key]]
    if differ:
        warnings.warn(f"{ctx.export_dir}/{tuned_file} was tuned on other latency: {'; '.join(differ)}; rerun "
                      "medusa-tune-tree with this run's dtype and cpu_kernels for the tree that fits", RuntimeWarning,
                      stacklevel=2)


def _draft(settings: DraftConfig, ctx: BuildContext, name: str) -> tuple[Any, Any, dict[str, Any]]:
    """(draft model, its tokenizer or None, info) for decoder ``name``'s ``settings``; a separate model takes the
    run's dtype/device overrides and is loaded once per run however many decoders use it.

    Raises:
        ValueError: a self-layers draft as deep as the target (``decoder.<name>.num_layers`` and the target's layer
            count named), or the draft's own errors.
    """
    from medusa_train.config.schema import ModelConfig, as_dataclass
    from inference.draft_loading import load_draft

    if settings.kind == "self_layers":
        layers = getattr(ctx.model.base.config, "num_hidden_layers", None)
        if isinstance(layers, int) and settings.num_layers >= layers:
            fix = (f"set decoder.{name}.num_layers to at most {layers - 1} (e.g. decoder.{name}.num_layers="
                   f"{max(1, layers // 2)})" if layers > 1 else f"use decoder.{name}.kind=model with a smaller model")
            raise ValueError(f"decoder.{name}.num_layers={settings.num_layers}: a self_layers draft keeps fewer layers "
                             f"than the target, which has {layers}; {fix}, or leave {name} out of decoders")
    if settings.kind == "model":
        model_cfg = as_dataclass(ModelConfig, settings.model)
        overrides = {k: v for k, v in (("dtype", ctx.dtype), ("device", ctx.device)) if v is not None}
        settings = dataclasses.replace(settings, model=dataclasses.replace(model_cfg, **overrides))
        key = repr(settings.model)
        info = {"draft": "model", "draft_model": settings.model.name_or_path}
    else:
        key = f"self_layers:{settings.num_layers}"
        info = {"draft": "self_layers", "draft_layers": settings.num_layers}
    if key not in ctx.drafts:
        ctx.drafts[key] = load_draft(settings, ctx.model.base, ctx.tokenizer)
        if settings.kind == "model" and ctx.kernels is not None:  # self_layers shares the target's converted layers
            from medusa_train.loading.cpu_kernels import apply_cpu_kernels

            apply_cpu_kernels(ctx.drafts[key][0], ctx.kernels)
    draft, draft_tokenizer = ctx.drafts[key]
    return draft, draft_tokenizer, info


def _build_draft(settings: DraftSettings, ctx: BuildContext) -> BuiltDecoder:
    from inference.decoders.draft import DraftDecoder

    draft, draft_tokenizer, info = _draft(settings, ctx, "draft")
    decoder = DraftDecoder(ctx.model.base, draft, num_draft_tokens=settings.num_draft_tokens,
                           schedule=settings.schedule, tokenizer=ctx.tokenizer, draft_tokenizer=draft_tokenizer,
                           confidence_threshold=settings.confidence_threshold)
    return BuiltDecoder(decoder, info)


def _build_hf_assisted(settings: HfAssistedSettings, ctx: BuildContext) -> BuiltDecoder:
    from inference.decoders.hf_peers import HfAssistedDecoder

    draft, draft_tokenizer, info = _draft(settings, ctx, "hf_assisted")
    decoder = HfAssistedDecoder(ctx.model.base, draft, num_draft_tokens=settings.num_draft_tokens,
                                schedule=settings.schedule, confidence_threshold=settings.confidence_threshold,
                                tokenizer=ctx.tokenizer, draft_tokenizer=draft_tokenizer)
    return BuiltDecoder(decoder, info)


def _build_lookahead(settings: LookaheadSettings, ctx: BuildContext) -> BuiltDecoder:
    from inference.decoders.lookahead import LookaheadDecoder

    decoder = LookaheadDecoder(ctx.model.base, window=settings.window, ngram=settings.ngram,
                               guesses=settings.guesses, prompt_ngrams=settings.prompt_ngrams,
                               tokenizer=ctx.tokenizer)
    return BuiltDecoder(decoder)


def _build_hf_prompt_lookup(settings: HfPromptLookupSettings, ctx: BuildContext) -> BuiltDecoder:
    from inference.decoders.hf_peers import HfPromptLookupDecoder

    decoder = HfPromptLookupDecoder(ctx.model.base, num_draft_tokens=settings.num_draft_tokens,
                                    max_matching_ngram_size=settings.max_matching_ngram_size,
                                    tokenizer=ctx.tokenizer)
    return BuiltDecoder(decoder)


def _build_vllm(settings: VllmSettings, ctx: BuildContext, name: str = "vllm") -> BuiltDecoder:
    import torch

    from inference.decoders.vllm import VllmDecoder
    from medusa_train.models.catalog import vllm_drafter_type
    from medusa_train.engines.vllm_env import SPECULATIVE_FILE, VllmWorker, tuned_speculative_tokens
    from medusa_train.export.configs import dtype_name
    from medusa_train.loading.base import engine_model_path

    if ctx.model_config is None:
        raise ValueError(f"decoder {name!r} runs in medusa-eval and benchmarks/serve_vllm.py (it needs the target's "
                         "model config, BuildContext.model_config, and does not stream)")
    spec, k_source = None, None
    method = getattr(settings, "method", None)  # None: plain decoding
    if isinstance(settings, VllmDraftSettings):
        draft = _draft_model_config(settings.model, ctx)
        spec = {"method": method, "model": engine_model_path(draft),
                "num_speculative_tokens": settings.num_speculative_tokens}
        k_source = f"decoder.{name}.num_speculative_tokens"
    elif isinstance(settings, VllmNgramSettings):
        spec = {"method": method, "num_speculative_tokens": settings.num_speculative_tokens,
                "prompt_lookup_max": settings.prompt_lookup_max, "prompt_lookup_min": settings.prompt_lookup_min}
        k_source = f"decoder.{name}.num_speculative_tokens"
    elif method is not None:
        k_source = (f"decoder.{name}.num_speculative_tokens" if settings.num_speculative_tokens is not None else
                    f"export {SPECULATIVE_FILE}" if tuned_speculative_tokens(ctx.export_dir, method) else
                    "the export's default")
        # the method's drafter type gives the config; it refuses an export of another type before vLLM starts
        spec = vllm_drafter_type(method).vllm_config(ctx.export_dir, settings.num_speculative_tokens)
    model_path = engine_model_path(ctx.model_config)
    dtype = dtype_name(ctx.model.base.dtype)  # the dtype our decoders run in, whatever the config said
    # Timed beside ours: as many compute threads as our decoders on a CPU, and stopped between its turns, so
    # that neither side's figure carries the other's load (medusa_train/engines/vllm_env.py).
    threads = torch.get_num_threads() if ctx.model.base.device.type == "cpu" else None
    worker = VllmWorker(model_path, dtype=dtype, speculative_config=spec, max_model_len=settings.max_model_len,
                        max_num_seqs=1, enforce_eager=settings.enforce_eager,
                        gpu_memory_utilization=settings.gpu_memory_utilization, compute_threads=threads,
                        pause_when_idle=True)
    info = {"engine": f"vllm {worker.vllm_version}", "engine_model": model_path, "engine_dtype": dtype,
            "engine_start_s": worker.info["start_s"], "speculative_config": spec,
            "num_speculative_tokens_source": k_source, "engine_log": str(worker.log_path),
            "compute_threads": threads, "paused_between_turns": True}
    return BuiltDecoder(VllmDecoder(worker, name, settings.max_model_len), info)


def _build_vllm_draft(settings: VllmDraftSettings, ctx: BuildContext) -> BuiltDecoder:
    return _build_vllm(settings, ctx, "vllm_draft")


def _build_vllm_ngram(settings: VllmNgramSettings, ctx: BuildContext) -> BuiltDecoder:
    return _build_vllm(settings, ctx, "vllm_ngram")


def _draft_model_config(model: Any, ctx: BuildContext) -> Any:
    """The ``model/`` config of an engine decoder's separate draft model, with the run's dtype and device."""
    from medusa_train.config.schema import ModelConfig, as_dataclass

    cfg = as_dataclass(ModelConfig, model)  # None was refused by the request check (_needs_draft_model)
    overrides = {k: v for k, v in (("dtype", ctx.dtype), ("device", ctx.device)) if v is not None}
    return dataclasses.replace(cfg, **overrides)


def _build_llamacpp(settings: LlamaCppSettings, ctx: BuildContext, name: str = "llamacpp") -> BuiltDecoder:
    import torch

    from inference.decoders.llamacpp import LlamaCppDecoder
    from inference.engines.llamacpp_server import LlamaServer
    from medusa_train.models.catalog import vllm_drafter_type
    from medusa_train.loading.base import engine_model_path

    if ctx.model_config is None:
        raise ValueError(f"decoder {name!r} runs in medusa-eval (it needs the target's model config, "
                         "BuildContext.model_config, and does not stream)")
    target = _target_gguf(settings, ctx.model_config, name)
    draft, draft_max, info, spec_type, options = None, 0, {}, None, []
    method = getattr(settings, "method", None)  # None: plain decoding
    if isinstance(settings, LlamaCppDraftSettings):
        draft_cfg = _draft_model_config(settings.model, ctx)
        draft = _gguf_file(draft_cfg, f"decoder.{name}.model")
        draft_max, spec_type = settings.draft_max, settings.spec_type
        info = {"draft_gguf": draft, "draft_max": draft_max, "draft_p_min": settings.draft_p_min,
                "spec_type": spec_type}
    elif isinstance(settings, LlamaCppNgramSettings):
        draft_max, spec_type = settings.draft_max, settings.spec_type
        options = ["--spec-ngram-simple-size-n", str(settings.ngram_size), "--spec-ngram-simple-size-m",
                   str(settings.draft_max)]
        info = {"spec_type": spec_type, "ngram_size": settings.ngram_size, "draft_max": draft_max}
    elif method is not None:  # the method's drafter type refuses an export of another type before anything converts
        entry = vllm_drafter_type(method)
        draft_max = entry.vllm_config(ctx.export_dir, settings.draft_max, recorded=False)["num_speculative_tokens"]
        if settings.drafter_gguf is not None:
            draft = settings.drafter_gguf
        else:
            draft = str(entry.llamacpp_gguf(ctx.export_dir, engine_model_path(ctx.model_config), settings.outtype))
        spec_type = settings.spec_type
        info = {"drafter_gguf": draft, "draft_max": draft_max, "draft_max_source":
                f"decoder.{name}.draft_max" if settings.draft_max is not None else "the export's speculative_tokens",
                "draft_p_min": settings.draft_p_min,
                "drafter_source": f"decoder.{name}.drafter_gguf" if settings.drafter_gguf is not None else
                f"converted to {draft}"}
    # Timed beside ours: as many compute threads as our decoders on a CPU, stopped between its turns.
    threads = torch.get_num_threads() if ctx.model.base.device.type == "cpu" else None
    server = LlamaServer(target, draft, draft_max=max(draft_max, 1), draft_p_min=getattr(settings, "draft_p_min", None),
                         threads=threads or torch.get_num_threads(), ctx_size=settings.ctx_size, pause_when_idle=True,
                         repack=settings.repack, spec_type=spec_type, spec_options=options)
    info = {"engine": f"llama.cpp {server.info['version']}", "engine_model": target,
            "engine_start_s": server.info["start_s"], "engine_log": server.info["log"], "compute_threads": threads,
            "paused_between_turns": True, "repack": settings.repack, **info}
    return BuiltDecoder(LlamaCppDecoder(server, name, settings.ctx_size, draft_max), info)


def _target_gguf(settings: LlamaCppSettings, model_config: Any, name: str) -> str:
    """The target GGUF llama.cpp loads: ``decoder.<name>.target_gguf``, else the model config's GGUF file.

    Raises:
        ValueError: neither (an HF or llama2.c target: the setting and the converter named), or a missing file.
    """
    from pathlib import Path

    if settings.target_gguf is not None:
        path = Path(settings.target_gguf)
        if not path.is_file():
            raise ValueError(f"decoder.{name}.target_gguf: {path} does not exist")
        return str(path)
    return _gguf_file(model_config, f"decoder.{name}.target_gguf")


def _gguf_file(model_config: Any, key: str) -> str:
    """The GGUF file a ``model/`` config of format ``gguf`` names
    (:func:`~medusa_train.loading.conversion_cache.gguf_location`).

    Raises:
        ValueError: the model is not a GGUF (``key`` and the converter named), or the file is missing.
    """
    from medusa_train.loading.base import detect_format
    from medusa_train.loading.conversion_cache import gguf_location

    if detect_format(model_config) != "gguf":
        raise ValueError(f"{key}: llama.cpp loads models as GGUF files and {model_config.name_or_path} is not one; "
                         "convert it with `.venv-llamacpp/bin/python .llamacpp/src/convert_hf_to_gguf.py MODEL_DIR "
                         f"--outfile model.gguf` and set {key} to it")
    try:
        folder, name = gguf_location(model_config)
    except FileNotFoundError as e:
        raise ValueError(f"{key}: {e}") from e
    return str(folder / name)


def _build_llamacpp_draft(settings: LlamaCppDraftSettings, ctx: BuildContext) -> BuiltDecoder:
    return _build_llamacpp(settings, ctx, "llamacpp_draft")


def _build_llamacpp_ngram(settings: LlamaCppNgramSettings, ctx: BuildContext) -> BuiltDecoder:
    return _build_llamacpp(settings, ctx, "llamacpp_ngram")


# --- the registry ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderEntry:
    """One decoder: its settings schema and how to build it.

    Attributes:
        name: the decoder's name in configs, results and summaries.
        settings: a dataclass with defaults, numeric ranges declared in its fields' metadata
            (:func:`medusa_train.config.bounds.bound`), and a ``validate()`` for the rest that raises ``ValueError`` naming
            the field.
        build: ``(settings, BuildContext) -> BuiltDecoder``; called once the target model is loaded.
        summary: one line for listings.
        check_request: ``(settings, request) -> None``, raising ``ValueError`` when the decoder cannot serve the
            request (e.g. greedy-only decoders at temperature > 0); run before any model loads.
        uses_heads: the decoder decodes with the export's heads, so its measurements depend on them (``medusa-eval``
            re-measures its rows when the heads' checksum changes).
        default: part of medusa-eval's default ``decoders`` (the vLLM and llama.cpp engines are not: they need
            their own environment or build and time to start).
        engine: where it runs, one of :data:`ENGINES`.
        baseline: the decoder its speedup and exact match are measured against when that decoder ran in the same
            run: :data:`BASELINE` for our decoders and the engines' plain rows; an engine's plain row (``vllm``,
            ``llamacpp``) for that engine's speculative rows, whose replies follow the engine's own numerics (see
            :func:`baseline_of`).
    """

    name: str
    settings: type
    build: Callable[[Any, BuildContext], BuiltDecoder]
    summary: str
    check_request: Optional[Callable[[Any, DecodeConfig], None]] = None
    uses_heads: bool = False
    default: bool = True
    engine: str = "ours"
    baseline: str = BASELINE

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"decoder {self.name!r}: engine {self.engine!r} is not one of {', '.join(ENGINES)}")


REGISTRY: dict[str, DecoderEntry] = {}


def baseline_of(name: str, ran: Sequence[str]) -> str:
    """The decoder whose rows ``name``'s speedup and exact match are measured against in a run of the decoders
    ``ran``: its entry's :attr:`~DecoderEntry.baseline` when that one ran, else :data:`BASELINE` (``name`` itself for
    the baseline). Unregistered names (a test's own decoders) take :data:`BASELINE`."""
    entry = REGISTRY.get(name)
    own = entry.baseline if entry is not None else BASELINE
    return own if own in ran and own != name else BASELINE


def register_decoder(entry: DecoderEntry) -> None:
    """Add (or replace) a decoder entry."""
    REGISTRY[entry.name] = entry


for _entry in (
    DecoderEntry("vanilla", VanillaSettings, _build_vanilla, "plain decoding, one target pass per token"),
    DecoderEntry("tree", TreeSettings, _build_tree,
                 "the export's drafter (any type) drafts a tree, one target pass verifies it",
                 _check_tree_request("tree"), uses_heads=True),
    DecoderEntry("medusa", TreeSettings, _build_old_tree, "tree under its old name (medusa_train.config.renames)",
                 _check_tree_request("medusa"), uses_heads=True, default=False),
    DecoderEntry("composite", CompositeSettings, _build_composite,
                 "the export's heads' candidates and prompt lookup's in one tree, one target pass verifies it",
                 _check_tree_request("composite"), uses_heads=True),
    DecoderEntry("draft", DraftSettings, _build_draft, "a draft model proposes K tokens, one target pass verifies"),
    DecoderEntry("lookahead", LookaheadSettings, _build_lookahead, "Jacobi n-gram pool, no draft model (greedy)",
                 _greedy_only("lookahead")),
    DecoderEntry("hf_assisted", HfAssistedSettings, _build_hf_assisted,
                 "transformers generate(assistant_model=draft) (greedy)", _greedy_only("hf_assisted")),
    DecoderEntry("hf_prompt_lookup", HfPromptLookupSettings, _build_hf_prompt_lookup,
                 "transformers generate(prompt_lookup_num_tokens=K) (greedy)", _greedy_only("hf_prompt_lookup")),
    DecoderEntry("vllm", VllmSettings, _build_vllm, "plain decoding in vLLM (its own environment)",
                 _check_vllm_request, default=False, engine="vllm"),
    DecoderEntry("llamacpp", LlamaCppSettings, _build_llamacpp,
                 "plain decoding in llama.cpp's llama-server on the target's GGUF (launch/install_llamacpp.sh)",
                 _check_llamacpp_request, default=False, engine="llamacpp"),
    DecoderEntry("vllm_draft", VllmDraftSettings, _build_vllm_draft,
                 "vLLM's draft-model speculation with a separate draft model (a chain of K drafts)",
                 _needs_draft_model(_check_vllm_request, "vllm_draft"), default=False, engine="vllm", baseline="vllm"),
    DecoderEntry("vllm_ngram", VllmNgramSettings, _build_vllm_ngram,
                 "vLLM's n-gram speculation: prompt lookup in the prompt and reply (a chain of K drafts)",
                 _check_vllm_request, default=False, engine="vllm", baseline="vllm"),
    DecoderEntry("llamacpp_draft", LlamaCppDraftSettings, _build_llamacpp_draft,
                 "llama.cpp's draft-model speculative decoding with a separate draft GGUF (a chain of drafts)",
                 _needs_draft_model(_check_llamacpp_request, "llamacpp_draft"), default=False, engine="llamacpp",
                 baseline="llamacpp"),
    DecoderEntry("llamacpp_ngram", LlamaCppNgramSettings, _build_llamacpp_ngram,
                 "llama.cpp's n-gram self-speculation (ngram-simple: lookup in the prompt and reply)",
                 _check_llamacpp_request, default=False, engine="llamacpp", baseline="llamacpp"),
):
    register_decoder(_entry)

# the engines' builders and request checks, for the decoders the drafter catalog's types declare
_ENGINE_PARTS = {"vllm": (_build_vllm, _check_vllm_request), "llamacpp": (_build_llamacpp, _check_llamacpp_request)}
_FROM_CATALOG: list[str] = []  # the names sync_drafter_decoders registered


def sync_drafter_decoders() -> None:
    """Register the decoders the drafter catalog's types declare (:attr:`~medusa_train.models.catalog.DrafterType.
    engine_decoders`: ``vllm_medusa``, ``vllm_eagle3``, ``llamacpp_eagle3``, ...) as the catalog holds them now,
    after the registry's own; each runs in its engine, uses the export's drafter and is measured against the engine's
    plain decoder. Called by every function here that lists or checks names."""
    declared = [d for entry in drafter_types() for d in entry.engine_decoders]
    if [d.name for d in declared] == _FROM_CATALOG:
        return
    for name in _FROM_CATALOG:
        REGISTRY.pop(name, None)
    _FROM_CATALOG.clear()
    for decoder in declared:
        build, check = _ENGINE_PARTS[decoder.engine]
        register_decoder(DecoderEntry(decoder.name, decoder.settings, functools.partial(build, name=decoder.name),
                                      decoder.summary, check, uses_heads=True, default=False, engine=decoder.engine,
                                      baseline=decoder.engine))
        _FROM_CATALOG.append(decoder.name)


sync_drafter_decoders()


def decoder_names() -> tuple[str, ...]:
    """The registered decoder names, in registration order."""
    sync_drafter_decoders()
    return tuple(REGISTRY)


def default_decoder_names() -> tuple[str, ...]:
    """The decoders medusa-eval runs when ``decoders`` is not given: every registered one but the vLLM and
    llama.cpp engines."""
    sync_drafter_decoders()
    return tuple(name for name, entry in REGISTRY.items() if entry.default)


def register_decoder_schemas() -> None:
    """Store each registered decoder's settings in Hydra's ConfigStore as ``schema/decoder/<name>``, which
    ``conf/decoder/<name>.yaml`` extends, and :class:`~inference.draft_loading.DraftConfig` as ``schema/draft/base``,
    which ``conf/draft/*.yaml`` extend (idempotent: storing again replaces a node with the same one). Entry points
    call it before composing; importing this module stores nothing."""
    from hydra.core.config_store import ConfigStore

    sync_drafter_decoders()
    cs = ConfigStore.instance()
    for name, entry in REGISTRY.items():
        cs.store(group="schema/decoder", name=name, node=entry.settings)
    cs.store(group="schema/draft", name="base", node=DraftConfig)


def check_decoder_names(names: Sequence[str]) -> list[str]:
    """``names`` as a list, checked.

    Raises:
        ValueError: an empty list, an unknown name (the valid ones listed) or a name given twice.
    """
    sync_drafter_decoders()
    names = list(names)
    if not names:
        raise ValueError(f"decoders is empty: pick some of {', '.join(REGISTRY)}")
    for name in names:
        decoder_alias(name)  # an old name runs as before, warned (medusa_train.config.renames)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown decoder name(s) {unknown}; valid: {', '.join(REGISTRY)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"decoders lists {repeated} more than once")
    return names


def decoder_settings(name: str, raw: Any = None) -> Any:
    """The validated settings dataclass of decoder ``name`` from ``raw`` (a mapping, an OmegaConf node, an instance,
    or None for the defaults): the numeric ranges its fields declare (:func:`medusa_train.config.bounds.check_bounds`),
    then its ``validate()``.

    Raises:
        ValueError: unknown decoder, unknown key, wrong type or bad value; the message starts with ``decoder.<name>``
            (a value out of range: ``decoder.<name>.<field> must be ...``).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    check_decoder_names([name])
    cls = REGISTRY[name].settings
    try:
        if isinstance(raw, cls):
            settings = raw
        else:
            node = OmegaConf.structured(cls)
            if dataclasses.is_dataclass(raw):
                raw = dataclasses.asdict(raw)
            if raw is not None and not (OmegaConf.is_dict(raw) or isinstance(raw, Mapping)):
                raise TypeError(f"settings must be a mapping of key: value, got {type(raw).__name__}")
            if raw is not None:
                node = OmegaConf.merge(node, raw)
            settings = OmegaConf.to_object(node)
    except (ValueError, TypeError, OmegaConfBaseException) as e:
        raise ValueError(f"decoder.{name}: {e}") from e
    check_bounds(settings, f"decoder.{name}")
    try:
        settings.validate()
    except (ValueError, TypeError, OmegaConfBaseException) as e:
        raise ValueError(f"decoder.{name}: {e}") from e
    return settings


def takes_draft(name: str) -> bool:
    """Whether decoder ``name`` drafts with a draft model its settings name (a ``model`` field): ``draft``,
    ``hf_assisted``, ``vllm_draft``, ``llamacpp_draft``."""
    check_decoder_names([name])
    return any(f.name == "model" for f in dataclasses.fields(REGISTRY[name].settings))


def with_run_draft(name: str, raw: Any, draft: Any) -> dict[str, Any]:
    """Decoder ``name``'s settings ``raw`` with the run's draft model (``medusa-eval draft=<draft preset>``) filled
    in: its ``kind``, ``num_layers`` and ``model`` for our decoders (:class:`~inference.draft_loading.DraftConfig`'s
    fields), its ``model`` for the engines'. The draft length stays each decoder's own setting (the engines' best
    lengths differ).

    Args:
        name: a decoder that :func:`takes_draft`.
        raw: its settings (a mapping, an OmegaConf node or a settings instance; None: the defaults).
        draft: the run's draft (a ``draft/`` config).

    Raises:
        ValueError: the draft is invalid, ``decoder.<name>.model`` names another draft model as well (keep one),
            or an engine is given a ``self_layers`` draft (engines load a separate draft model).
    """
    from omegaconf import OmegaConf

    from medusa_train.config.schema import ModelConfig, as_dataclass

    run_draft = as_dataclass(DraftConfig, draft)
    if OmegaConf.is_config(raw):
        values = OmegaConf.to_container(raw, resolve=True)
    else:
        values = dataclasses.asdict(raw) if dataclasses.is_dataclass(raw) else dict(raw or {})
    fields = {f.name for f in dataclasses.fields(REGISTRY[name].settings)}
    own = values.get("model")
    if own is not None and (run_draft.kind != "model" or as_dataclass(ModelConfig, own) != as_dataclass(
            ModelConfig, run_draft.model)):
        raise ValueError(f"decoder.{name}.model and draft= both name a draft model: keep one (draft= sets it for "
                         "every decoder that drafts with a model)")
    if "kind" in fields:
        values.update(kind=run_draft.kind, num_layers=run_draft.num_layers, model=run_draft.model)
    elif run_draft.kind != "model":
        raise ValueError(f"decoder.{name}: draft= gives a {run_draft.kind} draft, and {name} loads a separate draft "
                         f"model: choose a draft/ preset of kind model (e.g. draft=qwen2_5_coder_0_5b) or leave {name} "
                         "out of decoders")
    else:
        values["model"] = run_draft.model
    if dataclasses.is_dataclass(values.get("model")):
        values["model"] = dataclasses.asdict(values["model"])
    return values


def check_request(name: str, settings: Any, request: DecodeConfig) -> None:
    """Raise ``ValueError`` when decoder ``name`` with ``settings`` cannot serve ``request`` (e.g. temperature > 0
    for a greedy-only decoder)."""
    check_decoder_names([name])
    entry = REGISTRY[name]
    if entry.check_request is not None:
        entry.check_request(settings, request)


def build_decoder(name: str, settings: Any, ctx: BuildContext) -> BuiltDecoder:
    """Build decoder ``name`` from its validated settings (see :func:`decoder_settings`) over ``ctx.model``.

    Raises:
        ValueError: unknown name (valid ones listed); errors of the decoder's constructor, prefixed with
            ``decoder.<name>`` when they do not name it.
    """
    check_decoder_names([name])
    try:
        return REGISTRY[name].build(settings, ctx)
    except ValueError as e:
        if str(e).startswith(f"decoder.{name}"):
            raise
        raise ValueError(f"decoder.{name}: {e}") from e


def build_decoders(settings: Mapping[str, Any], ctx: BuildContext) -> dict[str, BuiltDecoder]:
    """Build every decoder of ``settings`` (name -> validated settings, in order), reporting all that fail at once.

    Raises:
        ValueError: one line per decoder that could not be built (each starting with ``decoder.<name>``).
    """
    built: dict[str, BuiltDecoder] = {}
    errors: list[str] = []
    for name, value in settings.items():
        try:
            built[name] = build_decoder(name, value, ctx)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        close_decoders(built)
        raise ValueError("cannot build " + ("these decoders:\n  " if len(errors) > 1 else "") + "\n  ".join(errors))
    return built


def close_decoders(built: Mapping[str, BuiltDecoder]) -> None:
    """Stop what the decoders run outside this process (a vLLM engine): each decoder's ``close()``, when it has one."""
    for b in built.values():
        close = getattr(b.decoder, "close", None)
        if close is not None:
            close()


__all__ = [
    "BASELINE",
    "ENGINES",
    "BuildContext",
    "BuiltDecoder",
    "DecoderEntry",
    "DraftSettings",
    "HfAssistedSettings",
    "HfPromptLookupSettings",
    "LlamaCppDraftSettings",
    "LlamaCppNgramSettings",
    "LlamaCppSettings",
    "LookaheadSettings",
    "TreeSettings",
    "REGISTRY",
    "VanillaSettings",
    "VllmDraftSettings",
    "VllmNgramSettings",
    "VllmSettings",
    "baseline_of",
    "build_decoder",
    "build_decoders",
    "close_decoders",
    "check_decoder_names",
    "check_request",
    "decoder_names",
    "decoder_settings",
    "default_decoder_names",
    "register_decoder",
    "register_decoder_schemas",
    "takes_draft",
    "with_run_draft",
]
