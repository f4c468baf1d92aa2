"""Tree decoding: a drafter fills a tree of continuations, one target pass verifies it, the longest accepted path is
kept (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
Sec. 2.1.2, tree attention). :class:`TreeDecoder` runs any :class:`~medusa_train.models.tree_drafter.TreeDrafter`:
Medusa heads, Hydra heads, EAGLE-3 drafters (``model.head_type``,
:func:`~medusa_train.models.catalog.tree_drafter`), over a static tree or, for drafters that grow one, an
EAGLE-2 dynamic tree built anew every step (``dynamic_tree``, :mod:`medusa_train.tree.dynamic`); with ``composite``,
every step's tree also holds prompt lookup's drafts (:mod:`inference.proposers.composite`).

One step (:func:`tree_step`), following the split of FasterDecoding/Medusa ``medusa/model/utils.py`` at 10a2697
(generate candidates -> tree decoding -> evaluate posterior -> update inputs) with all state passed in and out:

a. **candidates**: the tree drafter fills every node from its own state (:mod:`medusa_train.models.tree_drafter`):
   Medusa heads' top-k at the last committed position, laid out as ``cat([root], head0_topk, head1_topk, ...)`` and
   picked per tree node with ``tree_indices``; Hydra heads (Ankner et al. 2024, which also read the node's path) level by level down the tree;
b. **tree pass**: ONE backbone pass over the N node tokens on top of the KV cache, with a 4-D additive mask
   ``[B, 1, N, L + N]`` (0 where a node may attend: every committed cache slot and its tree ancestors-or-self; the
   dtype's minimum elsewhere) and ``position_ids = committed length + depth``. transformers 5 passes a prepared 4-D mask through
   unchanged (``masking_utils._preprocess_mask_arguments``), so no modeling code is patched;
c. **verification**: base logits of every node (lm_head over the N hidden states), laid out along the root-to-leaf
   paths and handed to the acceptance rule (:mod:`medusa_train.tree.acceptance`);
d. **cache compaction**: the cache keeps the past and the accepted nodes only (:mod:`medusa_train.tree.kv_cache`:
   a cache preallocated for the request, written in place, compacted by an index copy);
e. **next step**: the drafter is given the accepted path's tokens and target features (``TreeDrafter.accept``; Medusa
   and Hydra heads keep the last accepted node's hidden state: one position, no second pass, and compute only the
   first D heads, D the tree's depth, :func:`medusa_tree`); the recovered or bonus token becomes the next step's
   root. Its KV entry is written by the next tree pass.

A step validates nothing (the request is checked once, before the prefill) and reads the host once; see
``docs/speed.md`` for what that saves and how the decoder overhead is measured.

Several prompts decode as one batch (:meth:`TreeDecoder.generate_batch`): each row verifies its own tree in the
shared pass and keeps its own path; rows that accept fewer tokens leave masked slots in the cache
(:mod:`inference.decoders.batching`), and finished rows leave the batch (and the drafter's state:
``TreeDrafter.select``).

Acceptance rules (``acceptance``):

- ``greedy`` (temperature 0 only): output identical to plain greedy decoding.
- ``typical``: Medusa's typical acceptance (Sec. 2.3.1); lossy at temperature > 0, greedy at temperature 0.
- ``speculative``: tree speculative sampling, lossless at any temperature. The candidates are the heads' top-k,
  a deterministic function of the heads' logits, so each drafted token is treated as a point mass
  (``draft_probs=None`` in :func:`medusa_train.tree.acceptance.tree_speculative_sample_batch`): child x is accepted with
  probability p(x), and on rejection p(x) is zeroed and p renormalised before the next sibling. This is exact for
  any deterministic candidate set; using the heads' softmax as q would not be, since the candidates were not drawn
  from it. At temperature 0 it is greedy acceptance.

Shapes: B batch, T sequence, K heads, N tree nodes, P paths, D tree depth, V vocabulary (V' the heads'), H hidden.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from inference.decoders.base import (
    DecodeConfig,
    DecodeResult,
    check_context,
    choose_token,
    make_generator,
)
from inference.decoders.batching import Replies, left_pad, prefill_mask, sliding_window
from inference.decoders.timing import StepTimes
from inference.proposers.composite import CompositeShape, CompositeTreeDrafter, priority_order
from medusa_train.models.catalog import tree_drafter
from medusa_train.models.features import FINAL
from medusa_train.models.generation import max_positions
from medusa_train.tree.acceptance import (
    check_posterior,
    greedy_accept_tokens,
    tree_speculative_sample_batch,
    typical_accept,
)
from medusa_train.tree.buffers import (
    TOPK,
    TreeBuffers,
    build_tree_buffers,
    default_medusa_choices,
    gather_paths,
    validate_medusa_choices,
)
from medusa_train.tree.composite import CompositeTree
from medusa_train.tree.composite import composite_tree as to_composite_tree
from medusa_train.models.tree_drafter import DynamicTreeDrafter, TreeDrafter
from medusa_train.tree.dynamic import DynamicTree, dynamic_tree as to_dynamic_tree
from medusa_train.tree.kv_cache import check_compactable, compact, preallocated_cache, select_rows, truncate
from medusa_train.tree.masks import additive_mask, positions
from medusa_train.tree.sampling import greedy_tokens, logits_to_probs

ACCEPTANCE_RULES = ("greedy", "typical", "speculative")
# The defaults of every tree-decoding setting, defined here only (the decoder, TreeSettings and medusa-tune-tree read
# them): Medusa's own (FasterDecoding/Medusa medusa/model/medusa_model.py at 10a2697, MedusaModel.medusa_generate):
# typical acceptance (greedy at temperature 0) with epsilon = 0.09 and delta = sqrt(epsilon) = 0.3.
ACCEPTANCE = "typical"
POSTERIOR_THRESHOLD = 0.09
POSTERIOR_ALPHA = 0.3
_FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")

# (node tokens long [B, N], node logits float [B, N, V]) ->
#   (accepted nodes below the root long [B, D], -1 after each row's accept length; accept lengths long [B];
#    next tokens long [B])
Verifier = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def medusa_tree(medusa_choices: Sequence[Sequence[int]], num_heads: int, topk: int,
                device: torch.device | str | None = None) -> TreeBuffers:
    """The tree's buffers, validated against the K = ``num_heads`` heads and built for the first D of them, D the
    tree's depth: a step computes and reads only those heads (``tree.num_heads == D``), so a 6-node tree of depth 2
    on 4 heads skips half the heads' work.

    Raises:
        ValueError: as :func:`medusa_train.tree.buffers.validate_medusa_choices` (against all K heads).
    """
    depth = max(len(p) for p in validate_medusa_choices(medusa_choices, num_heads, topk))
    return build_tree_buffers(medusa_choices, depth, topk, device=device)


def tree_attention_mask(tree_mask: Tensor, past: int | Tensor, dtype: torch.dtype) -> Tensor:
    """The additive 4-D mask of a tree pass.

    Args:
        tree_mask: bool ``[N, N]``, True where node i may see node j (ancestor-or-self).
        past: the cache's slots: an int L (one row, every slot visible) or bool ``[B, L]``, the slots each row
            may attend (False at padding and at slots left empty by other rows' longer accepts).
        dtype: the attention dtype (the model's).

    Returns:
        ``[B, 1, N, L + N]`` (B = 1 for an int ``past``) of ``dtype``: 0 where attention is allowed,
        ``finfo(dtype).min`` elsewhere.
    """
    if isinstance(past, int):
        past = torch.ones(1, past, dtype=torch.bool, device=tree_mask.device)
    return additive_mask(past, tree_mask, dtype)


def _path_nodes(tree: TreeBuffers, best_path: Tensor, accept_length: Tensor) -> Tensor:
    """Accepted nodes below the root, long ``[B, D]``: row b's path ``best_path[b]``, -1 after ``accept_length[b]``."""
    nodes = tree.retrieve_indices[best_path, 1:]  # [B, D]
    depth = torch.arange(nodes.shape[1], device=nodes.device)
    return torch.where(depth < accept_length[:, None], nodes, -1)


def check_acceptance(acceptance: str, config: DecodeConfig, key: str | None = None) -> None:
    """The one check that an acceptance rule can serve a request (the decoder runs it per request, ``medusa-eval``
    and ``medusa-generate`` before any model loads).

    Args:
        acceptance: ``greedy``, ``typical`` or ``speculative``.
        config: the request (temperature, top-k, top-p).
        key: the setting's name in the message (e.g. ``decoder.tree.acceptance``); None: the decoder's argument.

    Raises:
        ValueError: an unknown rule; ``greedy`` with temperature > 0; ``typical`` with top-k/top-p (it applies
            temperature only, Medusa paper Sec. 2.3.1).
    """
    shown = f"acceptance={acceptance!r}" if key is None else f"{key}={acceptance}"
    field = "acceptance" if key is None else key
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"{field} must be one of {ACCEPTANCE_RULES}, got {acceptance!r}")
    if acceptance == "greedy" and not config.greedy:
        raise ValueError(f"{shown} needs temperature=0 (got {config.temperature}); set {field}=speculative "
                         "(lossless) or typical to sample")
    if acceptance == "typical" and not config.greedy and (config.top_k or config.top_p < 1):
        raise ValueError(f"{shown} applies temperature only; set top_k=0 and top_p=1.0, or {field}=speculative")


def make_verifier(
    acceptance: str,
    tree: TreeBuffers,
    config: DecodeConfig,
    generator: torch.Generator | None,
    posterior_threshold: float = POSTERIOR_THRESHOLD,
    posterior_alpha: float = POSTERIOR_ALPHA,
) -> Verifier:
    """The acceptance rule as a :data:`Verifier` for one request (greedy whenever ``config.temperature == 0``).

    Raises:
        ValueError: as :func:`check_acceptance`.
    """
    check_acceptance(acceptance, config)

    valid = tree.retrieve_valid

    def greedy(node_tokens: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # The argmax once per node [B, N], then node tokens and target tokens along the root-to-leaf paths
        # [B, P, D+1].
        best, length, next_token = greedy_accept_tokens(gather_paths(node_tokens, tree),
                                                        gather_paths(greedy_tokens(logits), tree), valid)
        return _path_nodes(tree, best, length), length, next_token

    def typical(node_tokens: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        best, length, next_token = typical_accept(
            gather_paths(node_tokens, tree), gather_paths(logits, tree), tree.retrieve_valid, config.temperature,
            posterior_threshold, posterior_alpha, generator,
        )
        return _path_nodes(tree, best, length), length, next_token

    def speculative(node_tokens: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        target = logits_to_probs(logits, config.temperature, config.top_k, config.top_p)  # [B, N, V]
        return tree_speculative_sample_batch(tree, node_tokens, target, None, generator)

    if config.greedy:
        return greedy
    return typical if acceptance == "typical" else speculative


@dataclass(frozen=True)
class TreeStep:
    """What one :func:`tree_step` returns (B rows).

    Attributes:
        tokens: per row, the accepted drafted tokens then the recovered or bonus token (A_b + 1 tokens).
        root: long ``[B]``, each row's last token: the next step's root (not yet in the cache).
        past_valid: bool ``[B, L']``, the cache slots that hold each row's sequence after compaction
            (``L' = L + max_b(A_b + 1)``; a row that accepted fewer leaves masked slots).
        next_position: long ``[B]``, the position of each row's new root.
    """

    tokens: list[list[int]]
    root: Tensor
    past_valid: Tensor
    next_position: Tensor


def tree_pass(model: Any, cache: DynamicCache, tree: TreeBuffers, node_tokens: Tensor, past_valid: Tensor,
              next_position: Tensor, position_limit: int | None = None) -> dict[str, Tensor]:
    """Step (b): ONE backbone pass over the N nodes ``[B, N]`` on top of the cache (which it extends by N slots),
    with the tree's 4-D mask; returns the nodes' target features ``{name: [B, N, H]}``
    (:meth:`~medusa_train.models.speculative.SpeculativeModel.features`)."""
    mask = tree_attention_mask(tree.attn_mask, past_valid, model.base.dtype)  # [B, 1, N, L + N]
    node_positions = next_position[:, None] + tree.position_ids[None, :]  # [B, N]
    if position_limit is not None:
        node_positions = node_positions.clamp(max=position_limit - 1)
    features, _ = model.features(node_tokens, attention_mask=mask, position_ids=node_positions, cache=cache,
                                 use_cache=True)
    return features


def tree_step(
    model: Any,
    cache: DynamicCache,
    tree: TreeBuffers | DynamicTree | CompositeShape,
    drafter: TreeDrafter,
    root: Tensor,
    past_valid: Tensor,
    next_position: Tensor,
    verify: Verifier | Callable[[TreeBuffers], Verifier],
    position_limit: int | None = None,
) -> TreeStep:
    """One tree decoding step: candidates (``drafter.draft``), one tree pass, verification, cache compaction, and
    the accepted path handed to the drafter (``drafter.accept``).

    Per-request state (the cache's layer kinds, the tree, the acceptance rule) is checked by the caller once per
    request (:meth:`TreeDecoder.generate` does); the step itself validates nothing and synchronises with the host
    once, to read the accept lengths and emitted tokens together.

    Args:
        model: a :class:`~medusa_train.models.speculative.SpeculativeModel` (``hidden``, ``lm_head``).
        cache: KV cache of L slots (``L = past_valid.shape[1]``), compactable (:func:`medusa_train.tree.kv_cache.
            check_compactable`); updated in place.
        tree: buffers on the model's device (:func:`medusa_tree`: built for the D heads it reads, ``tree.num_heads``);
            or the shape of a tree the drafter grows this step (``drafter.draft_dynamic``,
            :class:`~medusa_train.models.tree_drafter.DynamicTreeDrafter`): a
            :class:`~medusa_train.tree.dynamic.DynamicTree`, or a :class:`~inference.proposers.composite.CompositeShape`
            (the drafter's candidates and prompt lookup's in one tree).
        drafter: fills the tree; started on this request (``drafter.start``) and given every earlier step's
            accepted path.
        root: long ``[B]``, each row's token after its committed sequence (already emitted, not yet in the cache).
        past_valid: bool ``[B, L]``, the cache slots of each row's sequence (all True for one prompt).
        next_position: long ``[B]``, the position of each root (its row's committed length).
        verify: the acceptance rule (:func:`make_verifier`); with a dynamic tree, a function of the step's tree
            returning it (e.g. ``lambda t: make_verifier(acceptance, t, config, generator)``).
        position_limit: the model's number of positions; node positions beyond it are clamped. Such nodes lie
            past ``max_new_tokens`` (checked by the caller), so neither they nor their descendants are kept.

    Returns:
        :class:`TreeStep`.
    """
    batch, past_length = past_valid.shape
    rows = torch.arange(batch, device=root.device)
    # (a) candidates: the token of every tree node [B, N], base ids, root first.
    if not isinstance(tree, TreeBuffers):  # the drafter grows this step's tree
        node_tokens, tree = drafter.draft_dynamic(root, tree)
        verify = verify(tree)
    else:
        node_tokens = drafter.draft(root, tree)
    # (b) tree pass: target features of every node {name: [B, N, H]}
    features = tree_pass(model, cache, tree, node_tokens, past_valid, next_position, position_limit)
    # (c) verification on the base logits of every node [B, N, V]: accepted nodes below the root [B, D] (-1 after
    #     each row's accept length), accept lengths [B], recovered-or-bonus tokens [B]
    accepted, length, next_token = verify(node_tokens, model.lm_head(features[FINAL]))

    # One host transfer: each row's accept length, its accepted tokens and next token, and its path's nodes.
    depth = accepted.shape[1]
    path = torch.cat([accepted.new_zeros(batch, 1), accepted], dim=1)  # [B, D + 1], root first, -1 padded
    emitted = node_tokens.gather(1, path.clamp(min=0))[:, 1:]  # [B, D], garbage after each row's length
    emitted = torch.cat([emitted, next_token[:, None]], dim=1).scatter(1, length[:, None], next_token[:, None])
    host = torch.cat([length[:, None], emitted, path], dim=1).tolist()  # [B, 1 + (D + 1) + (D + 1)]
    tokens = [row[1: row[0] + 2] for row in host]
    width = max(row[0] for row in host) + 1

    # (d) compaction: keep the past and each row's accepted path (root first), padded to the longest with masked
    #     repeats of the row's last accepted node. Nodes already in place (the root alone, or a path of the first
    #     nodes) need no copy.
    path = path[:, :width]
    kept = path >= 0
    last = path[rows, length]  # [B], each row's last accepted node
    padded = torch.where(kept, path, last[:, None])  # [B, W]
    if all(row[depth + 2: depth + 2 + width] == list(range(width)) for row in host):
        truncate(cache, past_length + width)
    else:
        compact(cache, past_length, padded[0] if batch == 1 else padded)

    # (e) the drafter takes the committed path: tokens [B, W] (-1 padded), features {name: [B, W, H]}, lengths [B].
    drafter.accept(torch.where(kept, node_tokens.gather(1, padded), -1),
                   {name: value[rows[:, None], padded] for name, value in features.items()}, length + 1)
    return TreeStep(tokens=tokens, root=next_token, past_valid=torch.cat([past_valid, kept], dim=1),
                    next_position=next_position + length + 1)


class TreeDecoder:
    """Tree decoding with the model's tree drafter (see the module docstring): Medusa heads, or Hydra heads drafting
    level by level (``model.head_type``, :func:`~medusa_train.models.catalog.tree_drafter`); the verification,
    acceptance rules and cache handling are the same for any drafter. Registered as the decoder ``medusa``.

    Args:
        model: a :class:`~medusa_train.models.speculative.SpeculativeModel` (Medusa or Hydra heads).
        medusa_choices: the tree, a prefix-closed list of rank paths (e.g. ``[[0], [0, 0], [1]]``).
        topk: candidates taken from each head (every rank in ``medusa_choices`` must be below it).
        acceptance: ``greedy``, ``typical`` or ``speculative``.
        posterior_threshold: typical acceptance's epsilon.
        posterior_alpha: typical acceptance's delta.
        tokenizer: optional; needed for ``stop_strings`` and to fill :attr:`DecodeResult.text`.
        dynamic_tree: None (the static tree ``medusa_choices``), or an EAGLE-2 dynamic tree grown anew every step
            (:class:`~medusa_train.tree.dynamic.DynamicTree`, or ``(depth, topk, total)``, or a mapping of them), for
            drafters that grow one (:class:`~medusa_train.models.tree_drafter.DynamicTreeDrafter`: EAGLE-3);
            ``medusa_choices`` and ``topk`` are then not used (``medusa_choices`` may be None).
        composite: None, or a :class:`~medusa_train.tree.composite.CompositeTree` (or a mapping of its fields):
            every step's tree merges the drafter's candidates (over ``medusa_choices`` or ``dynamic_tree``) with
            prompt lookup's drafts of the prompt and the reply so far, within its node budget
            (:mod:`inference.proposers.composite`); the drafter is then a
            :class:`~inference.proposers.composite.CompositeTreeDrafter` around the model's.

    Attributes:
        drafter: the :class:`~medusa_train.models.tree_drafter.TreeDrafter` every request starts
            (:func:`~medusa_train.models.catalog.tree_drafter` of ``model``); any drafter of the protocol may
            replace it.

    Raises:
        ValueError: an invalid tree (the message names the path), ``topk`` above the heads' vocabulary, an
            unknown acceptance rule, an invalid ``dynamic_tree`` (its field named) or one the drafter cannot grow, an
            invalid ``composite`` (``composite.<field>`` named: e.g. a lookup length of 0, or a node budget below
            the lookup drafts).
        NotImplementedError: an attention backend or layer layout that cannot take a custom 4-D mask.
    """

    name = "tree"

    def __init__(
        self,
        model: Any,
        medusa_choices: Sequence[Sequence[int]] | None,
        topk: int = TOPK,
        acceptance: str = ACCEPTANCE,
        posterior_threshold: float = POSTERIOR_THRESHOLD,
        posterior_alpha: float = POSTERIOR_ALPHA,
        tokenizer: Any = None,
        dynamic_tree: DynamicTree | Sequence[int] | dict | None = None,
        composite: CompositeTree | dict | None = None,
    ) -> None:
        for attr in ("hidden", "head_logits", "heads", "base"):
            if not hasattr(model, attr):
                raise TypeError(f"TreeDecoder needs a SpeculativeModel (missing .{attr}), got {type(model).__name__}")
        check_acceptance(acceptance, DecodeConfig(max_new_tokens=1))
        check_posterior(posterior_threshold, posterior_alpha)
        spec = model.heads.spec
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= spec.out_size:
            raise ValueError(f"topk must be an int in [1, {spec.out_size}] (the heads' vocabulary), got {topk!r}")
        attn = getattr(model.base.config, "_attn_implementation", None)
        if attn in _FLASH_ATTENTION:
            raise NotImplementedError(
                f"attn_implementation={attn!r} cannot take a custom 4-D tree mask; load the base model with "
                "attn_implementation='sdpa' or 'eager'"
            )
        self.window = sliding_window(model.base.config)
        self.model = model
        self.device = model.lm_head.weight.device
        self.drafter = tree_drafter(model)
        self.dynamic_tree = to_dynamic_tree(dynamic_tree)
        if self.dynamic_tree is None:
            self.tree: TreeBuffers | DynamicTree = medusa_tree(medusa_choices, spec.num_heads, topk, device=self.device)
        else:
            if not isinstance(self.drafter, DynamicTreeDrafter):
                raise ValueError(f"dynamic_tree: {type(self.drafter).__name__} drafts a static tree only "
                                 f"({model.head_type} heads); give medusa_choices and dynamic_tree=None")
            if self.dynamic_tree.topk > spec.out_size:
                raise ValueError(f"dynamic_tree.topk must be at most {spec.out_size} (the drafter's vocabulary), "
                                 f"got {self.dynamic_tree.topk}")
            self.tree = self.dynamic_tree
        self.composite = to_composite_tree(composite)
        if self.composite is not None:
            order = () if self.dynamic_tree is not None else priority_order(medusa_choices, self.tree)
            self.drafter = CompositeTreeDrafter(self.drafter, self.composite.max_matching_ngram_size)
            self.tree = CompositeShape(self.composite, self.tree, order)
        self.acceptance = acceptance
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, repo_or_dir: str, revision: str | None = None, **kwargs: Any) -> TreeDecoder:
        """Heads and tree from a Hub repository or an export folder, the base model from its
        ``base_model_name_or_path`` (downloaded when the machine reaches the Hub).

        ``kwargs``: ``model`` (a ``model/`` config overriding the recorded base), ``dtype``, ``device``, and any
        decoder argument (``topk``, ``acceptance``, ...). See
        :func:`inference.decoders.pretrained.pretrained_decoder_kwargs`.
        """
        from inference.decoders.pretrained import pretrained_decoder_kwargs

        return cls(**pretrained_decoder_kwargs(repo_or_dir, revision, **kwargs))

    def generate(
        self, input_ids: Tensor | Sequence[int], config: DecodeConfig, streamer: Any = None
    ) -> DecodeResult:
        """Decode one reply (see :class:`~inference.decoders.base.Decoder`).

        Raises:
            ValueError: empty prompt, batch > 1, prompt + ``max_new_tokens`` beyond ``max_position_embeddings``
                (or the sliding window), ``stop_strings`` without a tokenizer, or an acceptance rule that does not
                fit the temperature (see :func:`make_verifier`).
        """
        if isinstance(input_ids, Tensor) and input_ids.ndim == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"input_ids has batch {input_ids.shape[0]}; generate takes one prompt ([1, T]), "
                             "generate_batch several")
        return self._decode([input_ids], config, streamer)[0]

    def generate_batch(self, prompts: Sequence[Tensor | Sequence[int]], config: DecodeConfig) -> list[DecodeResult]:
        """Decode one reply per prompt in one batch (left-padded; finished rows leave the batch).

        Every row verifies its own tree in the shared pass and keeps its own accepted path; a row that accepts
        fewer tokens than the longest leaves masked slots in the cache. With greedy acceptance each row's tokens are
        those of plain greedy decoding of its prompt (up to floating-point rounding of batched kernels).
        ``wall_time_s`` and ``prefill_time_s`` of every result are the whole batch's.

        Raises:
            ValueError: as :meth:`generate`, for any prompt (its index named).
        """
        return self._decode(list(prompts), config, None)

    @torch.no_grad()
    def _decode(self, prompts: list, config: DecodeConfig, streamer: Any) -> list[DecodeResult]:
        model, tree = self.model, self.tree
        ids, valid = left_pad(prompts, self.device)
        lengths = valid.sum(dim=1)
        limit = max_positions(model.base.config)
        for length in lengths.tolist():
            check_context(length, config.max_new_tokens, limit)
            check_context(length, config.max_new_tokens, self.window,
                          "the sliding window (the tree's depth is reserved)", reserve=tree.max_depth)
        replies = Replies(len(prompts), config, self.tokenizer, streamer)
        generator = None if config.greedy else make_generator(config, self.device)
        if not isinstance(tree, TreeBuffers):  # a tree per step
            check_acceptance(self.acceptance, config)

            def verify(step_tree: TreeBuffers) -> Verifier:
                return make_verifier(self.acceptance, step_tree, config, generator, self.posterior_threshold,
                                     self.posterior_alpha)
        else:
            verify = make_verifier(self.acceptance, tree, config, generator, self.posterior_threshold,
                                   self.posterior_alpha)

        start = time.perf_counter()
        replies.feed.start(ids)
        # Full-attention layers only (the tree mask replaces the model's own masks), written in place: room for the
        # prompt, the reply and one tree beyond it.
        cache = preallocated_cache(ids.shape[1] + config.max_new_tokens + tree.num_nodes)
        features, _ = model.features(ids, attention_mask=prefill_mask(valid, model.base.dtype),
                                     position_ids=positions(valid), cache=cache, use_cache=True)  # {name: [B, T, H]}
        root = choose_token(model.lm_head(features[FINAL][:, -1]), config, generator)  # [B]
        times = StepTimes(self.device)
        drafter = times.timed(self.drafter)
        drafter.start(features, ids, valid)
        replies.first(root.tolist())
        prefill_time = time.perf_counter() - start
        check_compactable(cache)  # once per request: the step compacts without checking
        past_valid, next_position = valid, lengths
        while True:
            keep = replies.prune()
            if not replies.active:
                break
            if keep is not None:
                keep = keep.to(self.device)
                select_rows(cache, keep)
                drafter.select(keep)
                root, past_valid, next_position = root[keep], past_valid[keep], next_position[keep]
            step = tree_step(model, cache, tree, drafter, root, past_valid, next_position, verify, limit)
            times.step_done()
            replies.step(step.tokens)
            root, past_valid, next_position = step.root, step.past_valid, step.next_position
        return replies.results(lengths.tolist(), time.perf_counter() - start, prefill_time, **times.totals())

