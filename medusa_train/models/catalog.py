"""The drafter catalog: every kind of draft model this medusa-train trains, exports, tunes and decodes.

Each drafter type is one folder, :mod:`medusa_train.drafters` (``medusa/``, ``hydra/``, ``eagle3/``), whose package
registers the type with :func:`register`, its entry naming the folder's parts as real imports, the way vLLM's
``speculators`` registers one class per algorithm beside its implementation. Every other module asks the catalog
(:func:`drafter_type`, :func:`type_of`) what a type reads, how it is built, trained, exported, served and drafted
with; none compares a type's name or tests its class (``tests/test_drafter_catalog.py`` fails when one does).

A :class:`DrafterType` says:

- what it is: its spec class (a frozen dataclass deriving :class:`~medusa_train.models.heads_base.HeadsSpec`), its
  ``nn.Module`` class (built as ``module_cls(spec, token_map)``, with ``init_from_lm_head``, ``to_base_tokens``,
  ``token_map`` and ``dtype``), and ``options``: the dataclass of the ``heads.*`` settings only this type reads (their
  defaults, bounds and checks; the heads schema holds every registered type's,
  :func:`medusa_train.config.schema.heads_schema`), passed to its spec;
- what it reads of the target: ``features`` (names from :mod:`medusa_train.models.features`, stored by the training cache)
  and whether it reads the teacher-forced path tokens t+1 .. t+K (``reads_path``);
- its loss: ``logits(heads, inputs, num_heads)`` gives its K heads' logits ``[K, ..., V']`` at the positions of
  :class:`TargetInputs`, teacher forced, which the one head loss (:mod:`medusa_train.training.losses`) scores
  (``sequence`` types read whole sequences and give the logits at the positions asked for); ``projected`` gives
  the same as features and a projection weight, so that the loss projects them onto the vocabulary in chunks;
- how it trains: ``joint`` (whether Medusa-2 may fine-tune the base with it);
- its export: ``layout`` (``medusa``: FasterDecoding's key layout, which FasterDecoding, TGI and vLLM load;
  ``state_dict``: the module's own parameter names in ``weights_file``), ``config_keys`` (the spec's counts in our
  ``config.json``) and, per engine, None where the engine serves it or the reason where it cannot (``engines``);
- its engine files: ``engine_writers``, per engine that serves it in a format of its own (EAGLE-3's ``speculators/``
  for vLLM), a function that checks the heads and returns the writer of those files (:meth:`DrafterType.engine_writer`),
  and ``engine_files``, the paths those writers own; engines without one get the layout's own files (Medusa's
  ``vllm/``);
- how engines serve it: ``vllm_method`` (vLLM's ``speculative_config`` method) with ``vllm_config``, the function
  giving that config for an export (:func:`vllm_drafter_type` finds the type of a method), ``llamacpp_gguf``, the
  conversion of an export's drafter into the GGUF llama.cpp drafts with, and ``engine_decoders``: the decoders that
  run it in an engine (:class:`EngineDecoder`: ``vllm_eagle3``, its settings and their defaults), which
  ``inference.registry`` registers beside its own;
- its tree drafter: ``tree_drafter``, a class built as ``tree_drafter(model)``
  (:class:`medusa_train.models.tree_drafter.TreeDrafter`; :func:`tree_drafter`).

Shapes: K heads, H hidden, V vocabulary (V' the heads').
"""

from __future__ import annotations

import importlib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from medusa_train.models.features import FINAL
from medusa_train.models.tree_drafter import DynamicTreeDrafter, TreeDrafter

# Export layouts (DrafterType.layout).
MEDUSA_LAYOUT = "medusa"  # FasterDecoding's keys (medusa_lm_head.safetensors/.pt), TGI's and vLLM's Medusa loaders
STATE_DICT_LAYOUT = "state_dict"  # the module's own parameter names in the type's weights file
LAYOUTS = (MEDUSA_LAYOUT, STATE_DICT_LAYOUT)
ENGINES = ("fasterdecoding", "tgi", "vllm")  # the engines an export may be written for, besides our own decoder
SERVING_ENGINES = ("vllm", "llamacpp")  # the engines a type's EngineDecoder may run it in
# The packages that register the built-in types, one folder each (imported on the first lookup).
BUILTIN_MODULES = ("medusa_train.drafters.medusa", "medusa_train.drafters.hydra", "medusa_train.drafters.eagle3")


@dataclass(frozen=True)
class TargetInputs:
    """What a drafter reads of the target model at some positions ``[...]``, teacher forced.

    Attributes:
        features: named target features (:mod:`medusa_train.models.features`), each ``[..., H]``.
        path_tokens: long ``[..., K]``, the tokens t+1 .. t+K of each position (None for types that do not read
            them).
        embed: the target's frozen input embeddings: long ``[...]`` -> ``[..., H]``.
        lm_head_weight: the target's lm_head ``[V, H]`` when the heads project with it (``share_lm_head``), else None.
        attention_mask: for a :attr:`DrafterType.sequence` type, whose ``[...]`` is ``[B, T]`` (whole sequences):
            ``[B, T]``, 1 on real tokens, 0 on padding; None: all real.
        positions: for a :attr:`DrafterType.sequence` type: ``(b, t)``, ``[M]`` long each, the positions whose
            logits are wanted (``[K', M, V']``); None: every position (``[K', B, T, V']``).
    """

    features: Mapping[str, torch.Tensor]
    path_tokens: torch.Tensor | None
    embed: Callable[[torch.Tensor], torch.Tensor]
    lm_head_weight: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    positions: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class EngineDecoder:
    """A decoder that runs a drafter type's export in an engine (``medusa-eval decoders=[...,<name>]``), declared by the
    type's catalog entry (:attr:`DrafterType.engine_decoders`) and registered by ``inference.registry``.

    Attributes:
        name: the decoder's name (``vllm_eagle3``).
        engine: where it runs, one of :data:`SERVING_ENGINES`; its speculative runs are measured against that engine's
            plain decoder (``vllm``, ``llamacpp``).
        settings: its settings dataclass (``decoder.<name>.*``), deriving the engine's plain settings
            (:class:`~medusa_train.engines.settings.VllmSettings`,
            :class:`~medusa_train.engines.settings.LlamaCppSettings`) and naming the type's method (``method:
            ClassVar[str]``, the type's :attr:`DrafterType.vllm_method`) and, for llama.cpp, its ``spec_type``
            (``--spec-type``).
        summary: one line for listings.
    """

    name: str
    engine: str
    settings: type
    summary: str

    def __post_init__(self) -> None:
        if self.engine not in SERVING_ENGINES:
            raise ValueError(f"engine decoder {self.name!r}: engine {self.engine!r} is not one of {SERVING_ENGINES}")
        if not isinstance(getattr(self.settings, "method", None), str):
            raise ValueError(f"engine decoder {self.name!r}: {self.settings.__name__} names no method (a ClassVar)")


# (heads or their DDP/DeepSpeed wrapper, inputs, num_heads: the first K' heads, None: all) -> [K', ..., V']
LogitsFn = Callable[[Any, TargetInputs, "int | None"], torch.Tensor]
# (features [K', ..., H], weight [V', H] shared by the heads or [K', V', H] one per head) -> anything: what the
# heads' projection onto the vocabulary is replaced by (training's chunked loss), logits[k] = features[k] @ weight^T
ProjectFn = Callable[[torch.Tensor, torch.Tensor], Any]
# (heads or their wrapper, inputs, num_heads, project_fn) -> project_fn's result, called inside the heads' forward
ProjectedFn = Callable[[Any, TargetInputs, "int | None", ProjectFn], Any]


@dataclass(frozen=True)
class DrafterType:
    """One kind of drafter (see the module docstring).

    Attributes:
        name: the ``head_type`` (``heads.head_type``, an export's ``config.json``).
        title: its name in messages (``Medusa``).
        spec_cls: its spec, a frozen dataclass deriving :class:`~medusa_train.models.heads_base.HeadsSpec`.
        module_cls: its ``nn.Module``, built as ``module_cls(spec, token_map)``.
        logits: its heads' teacher-forced logits (:data:`LogitsFn`).
        projected: the same heads' features and projection weight handed to a :data:`ProjectFn` inside the heads'
            forward (:data:`ProjectedFn`), for types whose logits are ``features @ weight^T``: training's loss
            then projects ``trainer.loss_chunk_size`` rows at a time (:mod:`medusa_train.training.chunked_loss`)
            instead of holding ``[K, M, V']`` logits. None: the loss reads :attr:`logits` (all at once).
        source: the paper it follows (title, section).
        options: the dataclass of the ``heads.*`` settings only this type reads (e.g. Hydra's ``combine``), fields of
            ``spec_cls`` too: their defaults and bounds (:func:`medusa_train.config.bounds.bound`), and a ``check_options()``
            method, when it has one, run on the heads config before anything loads (raising ``ValueError`` naming
            ``heads.<field>``); None: no options.
        features: the target features it reads (:mod:`medusa_train.models.features` names), when the same for every spec.
        features_of: ``spec -> names``, when they depend on the spec (EAGLE-3's layers); else None.
        target_fields: ``(target config, options) -> spec fields`` read from the target (EAGLE-3's attention shape and
            default layers), or None.
        reads_path: it also reads the path tokens t+1 .. t+k+1 (:attr:`TargetInputs.path_tokens`).
        sequence: its logits read whole sequences (EAGLE-3's training-time test attends to the positions before):
            :class:`TargetInputs` holds ``[B, T, ...]`` features and path tokens, the ``attention_mask`` and the
            ``positions`` wanted; else any positions ``[...]``, each on its own.
        joint: the joint recipe (``heads.mode=joint``, Medusa-2) may train it together with the base.
        layout: its export layout (:data:`LAYOUTS`).
        weights_file: the weights file of a ``state_dict`` layout.
        config_keys: ``spec.<field>`` -> its key in our ``config.json`` for the spec's own fields (the sizes
            ``hidden_size``, ``vocab_size``, ``share_lm_head``, ``head_vocab_size`` are common to all types).
        engines: engine (:data:`ENGINES`) -> None when it serves this type's export, else the reason it cannot.
        tree_drafter: its tree drafter class (:class:`~medusa_train.models.tree_drafter.TreeDrafter`), built as
            ``tree_drafter(model)``.
        engine_writers: engine -> a function called as ``(heads, *, base_model_name_or_path, base_model)``: it checks
            the heads for that engine (raising ``ValueError`` naming what does not fit) and returns
            ``write(folder)``, which writes the engine's files into the export folder; only for engines that serve
            the type (``engines[engine]`` None).
        engine_files: the paths (relative to the export folder) its engine writers write: an export owns them, so
            an earlier export's are never carried over (:func:`medusa_train.export.writer.owned_files`).
        vllm_method: vLLM's ``speculative_config`` method its export is served as (``medusa``, ``eagle3``); None
            where vLLM does not serve it.
        vllm_config: with ``vllm_method``: ``(export_dir, num_speculative_tokens=None, recorded=True) -> dict``,
            vLLM's ``speculative_config`` for an export (None: the length recorded in the export's
            ``vllm_speculative.json`` unless ``recorded`` is False, else the export's default), raising
            ``FileNotFoundError`` / ``ValueError`` before vLLM starts.
        llamacpp_gguf: ``(export_dir, target_model_dir, outtype="f32", force=False) -> Path``: converts an export's
            drafter into the GGUF llama.cpp drafts with beside the target's GGUF (and returns its path); None where
            llama.cpp has no drafter of the type.
        engine_decoders: the decoders that run its export in an engine (:class:`EngineDecoder`): a ``vllm`` one needs
            ``vllm_method``, a ``llamacpp`` one ``llamacpp_gguf``.
    """

    name: str
    title: str
    spec_cls: type
    module_cls: type[nn.Module]
    logits: LogitsFn
    source: str
    projected: ProjectedFn | None = None
    options: type | None = None
    features: tuple[str, ...] = (FINAL,)
    features_of: Callable[[Any], tuple[str, ...]] | None = None
    target_fields: Callable[[Any, Mapping[str, Any]], dict[str, Any]] | None = None
    reads_path: bool = False
    sequence: bool = False
    joint: bool = False
    layout: str = STATE_DICT_LAYOUT
    weights_file: str | None = None
    config_keys: Mapping[str, str] = field(default_factory=dict)
    engines: Mapping[str, str | None] = field(default_factory=dict)
    tree_drafter: type | None = None
    engine_writers: Mapping[str, Callable[..., Callable[[Any], None]]] = field(default_factory=dict)
    engine_files: tuple[str, ...] = ()
    vllm_method: str | None = None
    vllm_config: Callable[..., dict[str, Any]] | None = None
    llamacpp_gguf: Callable[..., Any] | None = None
    engine_decoders: tuple[EngineDecoder, ...] = ()

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"drafter type {self.name!r}: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == STATE_DICT_LAYOUT and not self.weights_file:
            raise ValueError(f"drafter type {self.name!r}: a state_dict layout needs its weights_file")
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown:
            raise ValueError(f"drafter type {self.name!r}: engines {unknown} are not among {ENGINES}")
        unserved = sorted(e for e in self.engine_writers if e not in self.engines or self.engines[e] is not None)
        if unserved:
            raise ValueError(f"drafter type {self.name!r}: engine_writers {unserved} are for engines it declares it "
                             "cannot serve (engines)")
        if (self.vllm_method is None) != (self.vllm_config is None):
            raise ValueError(f"drafter type {self.name!r}: vllm_method and vllm_config come together")
        if self.vllm_method is not None and self.engine_problem("vllm") is not None:
            raise ValueError(f"drafter type {self.name!r}: vllm_method {self.vllm_method!r} for an engine it declares "
                             "it cannot serve (engines)")
        for decoder in self.engine_decoders:
            needs = {"vllm": self.vllm_method, "llamacpp": self.llamacpp_gguf}[decoder.engine]
            if needs is None:
                raise ValueError(f"drafter type {self.name!r}: engine decoder {decoder.name!r} runs it in "
                                 f"{decoder.engine}, which the type does not map (vllm_method, llamacpp_gguf)")
        spec_fields = {f.name for f in fields(self.spec_cls)}
        missing = sorted({*self.option_names, *self.config_keys} - spec_fields)
        if missing:
            raise ValueError(f"drafter type {self.name!r}: {missing} are not fields of {self.spec_cls.__name__}")

    @property
    def option_names(self) -> tuple[str, ...]:
        """The names of its ``heads.*`` options (:attr:`options`' fields)."""
        return () if self.options is None else tuple(f.name for f in fields(self.options))

    def check_options(self, settings: Any) -> None:
        """Run its options' own check (``options.check_options``) on ``settings`` (the heads config), when any.

        Raises:
            ValueError: a bad option value (from the check, naming ``heads.<field>``).
        """
        check = getattr(self.options, "check_options", None)
        if check is not None:
            check(settings)

    def config_types(self) -> dict[str, Any]:
        """Its own ``config.json`` keys (:attr:`config_keys`' values) -> the spec fields' annotations (``int``,
        ``tuple[int, ...]``, ...), which the export's reader checks the values against."""
        hints = typing.get_type_hints(self.spec_cls)
        return {key: hints[name] for name, key in self.config_keys.items()}

    def feature_names(self, spec: Any) -> tuple[str, ...]:
        """The target features heads of ``spec`` read (:attr:`features`, or :attr:`features_of` of the spec)."""
        return self.features if self.features_of is None else tuple(self.features_of(spec))

    def engine_problem(self, engine: str) -> str | None:
        """Why ``engine`` cannot serve this type's export (None: it can). An engine not listed cannot."""
        if engine not in self.engines:
            return f"{self.title} heads have no {engine} layout"
        return self.engines[engine]

    def make_tree_drafter(self, model: Any) -> TreeDrafter:
        """Its tree drafter for ``model`` (a :class:`~medusa_train.models.speculative.SpeculativeModel` holding such heads).

        Raises:
            ValueError: the type declares no tree drafter.
        """
        if self.tree_drafter is None:
            raise ValueError(f"{self.title} heads (head_type {self.name!r}) declare no tree drafter")
        return self.tree_drafter(model)

    def engine_writer(self, engine: str) -> Callable[..., Callable[[Any], None]] | None:
        """The function writing this type's own files for ``engine`` (:attr:`engine_writers`), or None when the
        engine reads the layout's own files."""
        return self.engine_writers.get(engine)

    def config_fields(self, spec: Any) -> dict[str, Any]:
        """The spec's own fields as our ``config.json`` records them (:attr:`config_keys`)."""
        return {key: getattr(spec, name) for name, key in self.config_keys.items()}

    def spec_options(self, settings: Any) -> dict[str, Any]:
        """The :attr:`options` read from ``settings`` (e.g. ``cfg.heads``; an option it lacks takes its default)."""
        if self.options is None:
            return {}
        unset = self.options()
        return {name: getattr(settings, name, getattr(unset, name)) for name in self.option_names}


_CATALOG: dict[str, DrafterType] = {}
_loaded = False


def shifted_path_tokens(tokens: torch.Tensor, num_heads: int, pad: int = 0) -> torch.Tensor:
    """The teacher-forced path (:attr:`TargetInputs.path_tokens`) of every position: ``tokens [B, T]`` -> ``[B, T, K]`` with ``[b, t, j] = tokens[b, t +
    1 + j]``, ``pad`` past the end (such positions' heads have no target: t + k + 2 lies beyond T)."""
    B, T = tokens.shape
    padded = torch.cat([tokens, tokens.new_full((B, num_heads), pad)], dim=1)
    return torch.stack([padded[:, 1 + j : 1 + j + T] for j in range(num_heads)], dim=-1)


def register(entry: DrafterType) -> DrafterType:
    """Add ``entry`` to the catalog (a module registers its type on import) and return it.

    Raises:
        ValueError: another entry already has its name or its spec class.
    """
    old = _CATALOG.get(entry.name)
    if old is not None and old is not entry:
        raise ValueError(f"drafter type {entry.name!r} is registered twice ({old.module_cls.__module__} and "
                         f"{entry.module_cls.__module__})")
    clash = next((e.name for e in _CATALOG.values() if e.spec_cls is entry.spec_cls and e is not entry), None)
    if clash is not None:
        raise ValueError(f"drafter types {clash!r} and {entry.name!r} share the spec class {entry.spec_cls.__name__}")
    for other in _CATALOG.values():
        shared = sorted(set(other.option_names) & set(entry.option_names)) if other is not entry else []
        decoders = {d.name for d in other.engine_decoders} & {d.name for d in entry.engine_decoders}
        if shared or (decoders and other is not entry):
            raise ValueError(f"drafter types {other.name!r} and {entry.name!r} both declare "
                             f"{', '.join(shared or sorted(decoders))} (heads.* options and engine decoders are one "
                             "type's each)")
    _CATALOG[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove the type ``name`` (tests that register a type of their own)."""
    _CATALOG.pop(name, None)


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def drafter_types() -> tuple[DrafterType, ...]:
    """Every registered type: the built-ins first, in :data:`BUILTIN_MODULES` order (whichever module was imported
    first), then the others in registration order."""
    _load_builtins()

    def rank(entry: DrafterType) -> int:
        module = entry.module_cls.__module__
        return next((i for i, package in enumerate(BUILTIN_MODULES) if module.startswith(package + ".")),
                    len(BUILTIN_MODULES))

    return tuple(sorted(_CATALOG.values(), key=rank))


def head_types() -> tuple[str, ...]:
    """The registered types' names (``heads.head_type`` values)."""
    return tuple(e.name for e in drafter_types())


def titles(entries: Any) -> str:
    """``Medusa or Hydra``: the titles of ``entries`` joined for a message."""
    return " or ".join(e.title for e in entries)


def drafter_type(name: object, source: str = "head_type") -> DrafterType:
    """The registered type ``name``.

    Args:
        source: where the name was read, for the message (e.g. an export's ``config.json``, ``heads.head_type``).

    Raises:
        ValueError: no such type, naming ``source`` and the known types.
    """
    _load_builtins()
    entry = _CATALOG.get(name) if isinstance(name, str) else None
    if entry is None:
        known = ", ".join(head_types())
        raise ValueError(f"{source}: head_type {name!r} is not one this medusa-train knows ({known}); "
                         "upgrade medusa-train or check the setting")
    return entry


def type_of(obj: Any) -> DrafterType:
    """The type of a spec, heads module (DDP/DeepSpeed wrappers unwrapped) or model holding heads.

    Raises:
        TypeError: ``obj`` is none of those.
    """
    _load_builtins()
    obj = getattr(obj, "module", obj)  # DDP / DeepSpeed engine
    spec = getattr(obj, "spec", None) or getattr(getattr(obj, "heads", None), "spec", None) or obj
    for entry in _CATALOG.values():
        if type(spec) is entry.spec_cls:
            return entry
    raise TypeError(f"{type(obj).__name__} is not a registered drafter spec, heads module or model holding heads")


def is_drafter(module: Any) -> bool:
    """``module`` is the heads module of a registered type (not a wrapper, not a model holding heads)."""
    _load_builtins()
    return any(type(module) is e.module_cls for e in _CATALOG.values())


def tree_drafter(model: Any) -> TreeDrafter:
    """A new drafter for ``model``'s heads, before :meth:`~medusa_train.models.tree_drafter.TreeDrafter.start`: the one their
    type declares (:meth:`DrafterType.make_tree_drafter`).

    Raises:
        ValueError: a type without a tree drafter.
    """
    return type_of(model.heads).make_tree_drafter(model)


def grows_dynamic_trees(model: Any) -> bool:
    """Whether ``model``'s tree drafter (:func:`tree_drafter`) also grows EAGLE-2 dynamic trees
    (:class:`~medusa_train.models.tree_drafter.DynamicTreeDrafter`): decided by the protocol, for any drafter type.

    Raises:
        ValueError: a type without a tree drafter.
    """
    return isinstance(tree_drafter(model), DynamicTreeDrafter)


def vllm_methods() -> tuple[str, ...]:
    """vLLM's ``speculative_config`` methods the registered types serve as (:attr:`DrafterType.vllm_method`), in
    :func:`drafter_types` order: ``("medusa", "eagle3")``."""
    return tuple(e.vllm_method for e in drafter_types() if e.vllm_method is not None)


def vllm_drafter_type(method: str) -> DrafterType:
    """The registered type whose export vLLM serves as ``method`` (:attr:`DrafterType.vllm_method`).

    Raises:
        ValueError: no type serves as ``method`` (the methods named).
    """
    entry = next((e for e in drafter_types() if e.vllm_method == method), None)
    if entry is None:
        raise ValueError(f"no drafter type is served by vLLM as method {method!r} (methods: "
                         f"{', '.join(vllm_methods())})")
    return entry


def check_head_type(head_type: object, source: str) -> str:
    """``head_type`` when it is a registered type.

    Raises:
        ValueError: another value, naming ``source`` (e.g. an export's config.json) and the known types.
    """
    return drafter_type(head_type, source).name


def expect_head_type(found: str, wanted: str | None, source: str) -> None:
    """Refuse heads of type ``found`` where ``wanted`` heads were asked for (None: any type).

    Raises:
        ValueError: naming both head types and ``source``.
    """
    if wanted is None or wanted == found:
        return
    check_head_type(wanted, "the head type asked for")
    have, want = drafter_type(found).title, drafter_type(wanted).title
    raise ValueError(f"{source} holds {have} heads (head_type {found!r}), but {want} heads (head_type {wanted!r}) "
                     f"were asked for; use an export of {wanted} heads, or load these as {found} heads")


def heads_from_spec(spec: Any, token_map: torch.Tensor | None = None) -> nn.Module:
    """Zero-initialised heads of ``spec``'s type."""
    return type_of(spec).module_cls(spec, token_map)


def new_spec(head_type: str, options: Mapping[str, Any] | None = None, target_config: Any = None,
             **sizes: Any) -> Any:
    """The spec of a ``head_type`` drafter: ``sizes`` (the :class:`~medusa_train.models.heads_base.HeadsSpec` fields), the
    type's options (others in ``options`` are ignored) and what it reads of ``target_config`` (the target's
    ``PretrainedConfig``; :attr:`DrafterType.target_fields`).

    Raises:
        ValueError: an unknown type (the known ones named), a type that needs ``target_config`` without it, or an
            invalid value (from the spec).
    """
    _load_builtins()
    if head_type not in _CATALOG:
        raise ValueError(f"head_type must be {' or '.join(head_types())}, got {head_type!r}")
    entry = _CATALOG[head_type]
    chosen = {k: v for k, v in (options or {}).items() if k in entry.option_names}
    if entry.target_fields is not None:
        if target_config is None:
            raise ValueError(f"{entry.title} heads take their shape from the target model: pass its config")
        chosen = {**chosen, **entry.target_fields(target_config, chosen)}
    return entry.spec_cls(**sizes, **chosen)


def spec_for_config(heads_cfg: Any, target_config: Any, hidden_size: int, vocab_size: int) -> Any:
    """The spec of the drafter ``heads.*`` describes (:class:`~medusa_train.config.schema.HeadShape`) for a target of
    ``hidden_size`` H and ``vocab_size`` V (:func:`new_spec` with the type's options from the config).

    Raises:
        ValueError: ``heads.head_vocab_size`` above V (the field, V and the fix named: a preset's draft vocabulary,
            EAGLE-3's 4,096, is more than a small model has), or what :func:`new_spec` raises.
    """
    draft_vocab = heads_cfg.head_vocab_size
    if draft_vocab is not None and draft_vocab > vocab_size:
        raise ValueError(f"heads.head_vocab_size={draft_vocab} is more than the target's vocabulary of {vocab_size} "
                         f"tokens: set heads.head_vocab_size={vocab_size} or below")
    return new_spec(heads_cfg.head_type, drafter_type(heads_cfg.head_type, "heads.head_type").spec_options(heads_cfg),
                    target_config, num_heads=heads_cfg.num_heads, num_layers=heads_cfg.num_layers,
                    hidden_size=hidden_size, vocab_size=vocab_size, share_lm_head=heads_cfg.share_lm_head,
                    head_vocab_size=draft_vocab)


__all__ = ["BUILTIN_MODULES", "ENGINES", "LAYOUTS", "MEDUSA_LAYOUT", "SERVING_ENGINES", "STATE_DICT_LAYOUT",
           "DrafterType", "EngineDecoder", "LogitsFn",
           "ProjectFn", "ProjectedFn", "TargetInputs", "check_head_type", "drafter_type", "drafter_types",
           "expect_head_type", "grows_dynamic_trees", "head_types", "heads_from_spec", "is_drafter", "new_spec",
           "register", "shifted_path_tokens", "spec_for_config", "titles", "tree_drafter", "type_of",
           "unregister", "vllm_drafter_type", "vllm_methods"]
