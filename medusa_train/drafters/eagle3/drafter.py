"""EAGLE-3 drafters: one decoder layer fed by three of the target's layers and the embedding of the next token.

Source: Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test"
(arXiv:2503.01840), Sec. 3: the target's low, middle and high features are concatenated and fused by ``fc: 3H -> H``;
one decoder layer reads ``concat(embedding of token t+1, feature at t)`` (2H) and predicts token t+2; its own output
feature replaces the target's at the next draft step (the training-time test unrolls exactly that, Sec. 3.2).

The layout is what vLLM's ``Eagle3LlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle3.py``, vLLM 0.32)
computes, so that an export is served by vLLM as our decoder runs it, for every target (vLLM drafts EAGLE-3 with a
Llama layer whatever the target's architecture):

- ``embeds = input_layernorm(embed(token))``; ``residual = hidden``, ``hidden = hidden_norm(hidden)``
  (``norm_before_residual: false``: the residual is the un-normed input feature);
- ``x = cat([embeds, hidden])`` ``[.., 2H]`` through Llama attention whose q/k/v projections read 2H, RoPE at the
  query's position; ``s = attn + residual``;
- ``out = mlp(post_attention_layernorm(s)) + s``: the drafter's feature (vLLM's pre-norm ``aux_output``), fed back at
  the next draft step;
- ``logits = lm_head(norm(out))`` over the draft vocabulary (V' tokens; ``token_map [V']`` gives their target ids:
  vLLM's ``d2t`` offsets are ``token_map - arange(V')``, its ``t2d`` the mask of the target ids in the map).

The target's input embeddings are frozen and not part of this module (vLLM shares the target's when the export holds
none). Parameter names follow the speculators checkpoint (``fc``, ``midlayer.*``, ``norm``, ``lm_head``).

Shapes: B batch, T positions, L cached positions, H hidden, V' draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half

from medusa_train.models.catalog import ProjectFn, TargetInputs
from medusa_train.models.features import FINAL, layer_feature
from medusa_train.models.heads_base import HeadsSpec, register_token_map


@dataclass(frozen=True)
class Eagle3Spec(HeadsSpec):
    """Shape of an EAGLE-3 drafter: :class:`~medusa_train.models.heads_base.HeadsSpec` (``num_heads``: K, the draft steps the
    training-time test unrolls; ``num_layers``: 1, the one decoder layer vLLM reads; ``head_vocab_size``: the draft
    vocabulary) plus the decoder layer's shape, taken from the target's config.

    Attributes:
        feature_layers: the target layers fused by ``fc`` (:mod:`medusa_train.models.features` indices: the input of layer
            i; vLLM's default for an L-layer target is ``(2, L // 2, L - 3)``).
        num_attention_heads, num_key_value_heads, head_dim: the attention's shape (the target's).
        intermediate_size: the MLP's width (the target's).
        rms_norm_eps: every RMSNorm's epsilon.
        rope_theta: RoPE's base.
        max_position_embeddings: the positions RoPE covers.
    """

    feature_layers: tuple[int, ...] = (2, 15, 27)
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.num_layers != 1:
            raise ValueError(f"EAGLE-3 drafters have one decoder layer (heads.num_layers=1, what vLLM reads), "
                             f"got {self.num_layers}")
        if self.share_lm_head:
            raise ValueError("heads.share_lm_head=true: an EAGLE-3 drafter projects with its own lm_head over the "
                             "draft vocabulary (vLLM loads it from the export); set heads.share_lm_head=false")
        if len(self.feature_layers) != 3:
            raise ValueError(f"heads.feature_layers={list(self.feature_layers)}: EAGLE-3 fuses three target layers "
                             "(low, middle, high); give three indices")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    def layer_config(self) -> LlamaConfig:
        """The decoder layer's config as transformers (and vLLM's ``transformer_layer_config``) name it."""
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           attention_bias=False, mlp_bias=False, tie_word_embeddings=False)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read ``2H`` (the embedding and the feature), with an explicit
    additive mask and an optional KV cache of the drafter's own (a transformers ``Cache``, layer 0)."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        H, heads, kv, d = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv, d
        self.q_proj = nn.Linear(2 * H, heads * d, bias=False)
        self.k_proj = nn.Linear(2 * H, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * H, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, H, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: Any = None) -> torch.Tensor:
        """``x [B, T, 2H]`` -> ``[B, T, H]``.

        Args:
            rope: ``(cos, sin)`` ``[B, T, d]`` at the queries' positions.
            mask: additive ``[B, 1, T, L + T]`` (0 where a query may attend, a large negative number elsewhere), L the
                cached positions; None: causal over the T positions (no cache).
            cache: the drafter's KV cache (``cache.update(k, v, 0)`` appends these T positions and returns all L + T).
        """
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        k, v = self.expand(k), self.expand(v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and cache is None)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``x [B, T, 2H]`` -> ``(q [B, heads, T, d], k, v [B, kv_heads, T, d])``, RoPE applied to q and k."""
        return (self.project_query(x, rope), *self.project_context(x, rope))

    def project_query(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [B, M, 2H]`` -> ``q [B, heads, M, d]`` with RoPE (``rope`` ``[B, M, d]``)."""
        B, M, _ = x.shape
        return _rotate(self.q_proj(x).view(B, M, self.heads, self.head_dim).transpose(1, 2), rope)

    def project_context(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``x [B, T, 2H]`` -> ``(k, v)`` ``[B, kv_heads, T, d]`` with RoPE on k."""
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, rope), v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Keys or values ``[B, kv_heads, ..., d]`` repeated for each query head of their group:
        ``[B, heads, ..., d]``."""
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def attend_unrolled(self, q: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], context_mask: torch.Tensor,
                        drafted: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Attention of one unrolled draft step at every position t at once (the training-time test's mask).

        Query t reads the ``context`` keys/values at the positions ``context_mask`` allows it, and ``drafted``'s
        keys/values at t only (the steps drafted from t so far, this one's included).

        Args:
            q: ``[B, heads, T, d]``.
            context: ``(k, v)`` ``[B, kv_heads, T, d]`` each (step 0's).
            context_mask: additive ``[B, 1, T, T]`` (query, key): 0 where query t may read key s.
            drafted: ``(k, v)`` pairs ``[B, kv_heads, T, d]``, each read at its own position only.

        Returns:
            ``[B, T, H]`` (after ``o_proj``).
        """
        k0, v0 = self.expand(context[0]), self.expand(context[1])
        scale = self.head_dim ** -0.5
        scores = [(q @ k0.transpose(-1, -2)) * scale + context_mask]  # [B, heads, T, T]
        values = [self.expand(v) for _, v in drafted]
        scores += [((q * self.expand(k)).sum(-1, keepdim=True)) * scale for k, _ in drafted]  # [B, heads, T, 1] each
        weights = torch.cat(scores, dim=-1).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        T = k0.shape[2]
        out = weights[..., :T] @ v0
        for j, v in enumerate(values):
            out = out + weights[..., T + j : T + j + 1] * v
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Eagle3Layer(nn.Module):
    """The one decoder layer (``midlayer``): norms, attention over ``[embeds; feature]`` and the MLP."""

    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        config = spec.layer_config()
        self.input_layernorm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = Eagle3Attention(spec)
        self.post_attention_layernorm = LlamaRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter (see the module docstring).

    Parameters:
        fc: ``[H, 3H]``, the fusion of the three target features.
        midlayer: the decoder layer (:class:`Eagle3Layer`).
        norm: the final RMSNorm.
        lm_head: ``[V', H]``, the projection onto the draft vocabulary.
        token_map (buffer): ``[V']`` long, draft id -> target id, with a reduced draft vocabulary.
    """

    def __init__(self, spec: Eagle3Spec, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(spec, Eagle3Spec):
            raise TypeError(f"Eagle3Drafter needs an Eagle3Spec, got {type(spec).__name__}")
        self.spec = spec
        H = spec.hidden_size
        self.fc = nn.Linear(len(spec.feature_layers) * H, H, bias=False)
        self.midlayer = Eagle3Layer(spec)
        self.norm = LlamaRMSNorm(H, eps=spec.rms_norm_eps)
        self.lm_head = nn.Linear(H, spec.out_size, bias=False)
        register_token_map(self, spec, token_map)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @torch.no_grad()
    def init_from_lm_head(self, base_lm_head_weight: torch.Tensor) -> None:
        """Copy the target's lm_head ``[V, H]`` (the token map's rows) into ``lm_head``; the other weights keep
        PyTorch's default initialisation (fresh, random)."""
        weight = base_lm_head_weight if self.token_map is None else base_lm_head_weight[self.token_map]
        self.lm_head.weight.copy_(weight.to(self.lm_head.weight.dtype))

    def to_base_tokens(self, head_token_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape, long) -> target ids; the identity without a token map."""
        return head_token_ids if self.token_map is None else self.token_map[head_token_ids]

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``(cos, sin)`` ``[B, T, d]`` in ``x``'s dtype at ``position_ids [B, T]``: Llama's default rotary
        embedding (transformers' ``LlamaRotaryEmbedding`` of :meth:`Eagle3Spec.layer_config`), computed in fp32 on
        each call and kept in no buffer (so that nothing but weights is saved, cast or built on the meta device)."""
        d = self.spec.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d
        inv_freq = 1.0 / (self.spec.rope_theta ** exponents)  # [d / 2]
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def fuse(self, taps: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target features of :attr:`Eagle3Spec.feature_layers` (each ``[..., H]``, in that order) -> the fused
        feature ``[..., H]`` (``fc`` over their concatenation)."""
        return self.fc(torch.cat([t.to(self.dtype) for t in taps], dim=-1))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None, cache: Any = None, *,
                unroll: dict[str, Any] | None = None) -> Any:
        """One draft step at T positions.

        With ``unroll`` (training): ``self.unroll(**unroll)`` instead, the other arguments None (the training-time
        test runs through ``forward`` so that DDP and DeepSpeed wrappers see it).

        Args:
            hidden: ``[B, T, H]``, the feature at each position: the fused target feature (:meth:`fuse`) at a
                committed position, the drafter's own output (``out`` of the step before) at a drafted one.
            embeds: ``[B, T, H]``, the target's input embeddings of the token after each position.
            position_ids: long ``[B, T]``, the positions (RoPE).
            mask: additive ``[B, 1, T, L + T]`` (see :class:`Eagle3Attention`); None: causal, no cache.
            cache: the drafter's own KV cache (extended by these T positions), or None.

        Returns:
            ``(logits [B, T, V'], out [B, T, H])``: draft-vocabulary logits for the token two after each position,
            and the drafter's feature there (what the next step reads as ``hidden``).
        """
        if unroll is not None:
            return self.unroll(**unroll)
        x, residual = self._layer_input(hidden, embeds)
        s = self.midlayer.self_attn(x, self.rope(x, position_ids), mask, cache) + residual
        out = self._layer_output(s)
        return self.project(out), out

    def _layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x [B, T, 2H], residual [B, T, H])``: the normed embedding and feature side by side, the raw feature."""
        layer = self.midlayer
        hidden, embeds = hidden.to(self.dtype), embeds.to(self.dtype)
        return torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1), hidden

    def _layer_output(self, s: torch.Tensor) -> torch.Tensor:
        """The attention's output plus residual ``[B, T, H]`` -> the drafter's feature ``out`` (after the MLP)."""
        return self.midlayer.mlp(self.midlayer.post_attention_layernorm(s)) + s

    def unrolled_step(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                      context_mask: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None = None,
                      drafted: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
                      queries: torch.Tensor | None = None) -> tuple[Any, ...]:
        """One step of the training-time test at every position t of whole sequences (no KV cache), or at the
        positions ``queries`` only.

        Step 0 (``context`` None) is :meth:`forward` under ``context_mask``; its keys/values become the ``context``
        of the later steps. Step k > 0 at query t reads the context where ``context_mask`` allows it and the
        keys/values of steps 1..k at t (``drafted``, then its own): what draft step k at position t + k reads in
        decoding (the committed context up to t, then the drafted positions t+1 .. t+k).

        With ``queries`` (the compact unroll, :meth:`unroll` with ``at``): step 0 projects its keys/values at all T
        positions (every later query reads them) and its queries, attention and MLP at the M query positions only;
        its ``out`` and every later step's inputs and outputs are ``[B, M, ...]``, slot j of sequence b standing for
        position ``queries[b, j]``.

        Args:
            hidden: ``[B, T, H]``, the fused target feature (step 0) or the step before's ``out`` (``[B, M, H]``
                with ``queries``).
            embeds: ``[B, T, H]`` (``[B, M, H]`` after step 0 with ``queries``), the embeddings of the tokens t+k+1.
            position_ids: long ``[B, T]`` (``[B, M]`` after step 0 with ``queries``), t + k.
            context_mask: additive ``[B, 1, T, T]`` (query t, key s), 0 where query t may read step 0's key s;
                ``[B, 1, M, T]`` with ``queries`` (:func:`unrolled_context_mask`'s rows at the queries).
            context: step 0's ``(k, v)`` ``[B, kv_heads, T, d]``, or None at step 0.
            drafted: steps 1 .. k-1's ``(k, v)`` (``[B, kv_heads, M, d]`` with ``queries``).
            queries: long ``[B, M]``, the query positions of step 0 (padding slots repeat any real position), or None
                (every position).

        Returns:
            ``(out [B, T, H] or [B, M, H], context, drafted)``: the step's feature (:meth:`project` gives its
            logits) and the keys/values the next step reads.
        """
        x, residual = self._layer_input(hidden, embeds)
        attn = self.midlayer.self_attn
        if context is not None:
            q, k, v = attn.project(x, self.rope(x, position_ids))
            drafted = (*drafted, (k, v))
        elif queries is None:
            q, k, v = attn.project(x, self.rope(x, position_ids))
            context = (k, v)
        else:
            context = attn.project_context(x, self.rope(x, position_ids))
            x, residual = _rows(x, queries), _rows(residual, queries)
            q = attn.project_query(x, self.rope(x, position_ids.gather(1, queries)))
        s = attn.attend_unrolled(q, context, context_mask, list(drafted)) + residual
        return self._layer_output(s), context, drafted

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """The drafter's feature ``out [..., H]`` -> draft-vocabulary logits ``[..., V']`` (final norm, lm_head)."""
        return self.lm_head(self.norm(out))

    def unroll(self, taps: Sequence[torch.Tensor], path_embeds: torch.Tensor,
               attention_mask: torch.Tensor | None = None, num_steps: int | None = None,
               at: tuple[torch.Tensor, torch.Tensor] | None = None, project_fn: ProjectFn | None = None) -> Any:
        """The training-time test (EAGLE-3 paper, Sec. 3.2): K draft steps unrolled over whole sequences, teacher
        forced, each step's own feature fed to the next.

        Step 0 at position t reads the fused target feature at t and the embedding of token t+1, at position t, and
        attends causally to step 0 at s <= t (same sequence, not padding). Step k > 0 reads step k-1's ``out`` at t
        and the embedding of token t+k+1, at position t+k, and attends to step 0 at s <= t and steps 1..k at t
        (:meth:`unrolled_step`): what decoding computes when the drafts are right. Step k at t predicts token
        t+k+2, Medusa head k's target.

        Args:
            taps: the target features of :attr:`Eagle3Spec.feature_layers`, ``[B, T, H]`` each, in that order.
            path_embeds: ``[B, T, K, H]``, the input embeddings of the tokens t+1 .. t+K (frozen).
            attention_mask: ``[B, T]``, 1 on real tokens, 0 on padding (None: all real).
            num_steps: the first K' <= K steps (None: K, all embeddings given).
            at: ``(b, t)`` ``[M]`` long each: the logits there only (None: everywhere). Only step 0's keys/values
                are computed at all T positions; its queries and every later step run at these positions alone
                (:func:`loss_slots`' layout ``[B, Mmax]``), the same values as the full unroll's at ``at``.
            project_fn: training's chunked loss: ``project_fn(features [K', M, H] (or [K', B, T, H]), lm_head
                weight [V', H])`` is returned instead of the logits, the features after the final norm (what
                ``lm_head`` reads), so the loss projects them in chunks.

        Returns:
            float ``[K', B, T, V']``, or ``[K', M, V']`` with ``at`` (or ``project_fn``'s result).

        Raises:
            ValueError: fewer embeddings per position than steps, or taps not matching ``feature_layers``.
        """
        K = path_embeds.shape[2] if num_steps is None else num_steps
        if len(taps) != len(self.spec.feature_layers) or path_embeds.shape[2] < K:
            raise ValueError(f"unroll needs {len(self.spec.feature_layers)} taps and >= {K} path embeddings per "
                             f"position, got {len(taps)} taps and path_embeds {tuple(path_embeds.shape)}")
        B, T = path_embeds.shape[:2]
        positions = torch.arange(T, device=path_embeds.device).expand(B, T)
        queries, slots = (None, None) if at is None else loss_slots(at, B, T)
        mask = unrolled_context_mask(attention_mask, B, T, self.dtype, path_embeds.device, queries)
        hidden, context, drafted, normed = self.fuse(taps), None, (), []
        for k in range(K):
            embeds = path_embeds[:, :, k]
            if k == 0 or queries is None:
                step_positions = positions + k
            else:  # the compact unroll: steps after the first at the queries only
                embeds, step_positions = _rows(embeds, queries), queries + k
            hidden, context, drafted = self.unrolled_step(hidden, embeds, step_positions, mask, context, drafted,
                                                          queries)
            normed.append(self.norm(hidden if at is None else hidden[slots]))
        if project_fn is not None:
            return project_fn(torch.stack(normed), self.lm_head.weight)
        return torch.stack([self.lm_head(x) for x in normed])


def unrolled_context_mask(attention_mask: torch.Tensor | None, batch: int, length: int, dtype: torch.dtype,
                          device: torch.device | str, queries: torch.Tensor | None = None) -> torch.Tensor:
    """The additive mask ``[B, 1, T, T]`` (query t, key s) of step 0's keys in the training-time test: 0 where
    s <= t and s is a real token (``attention_mask [B, T]``, None: all real) or s = t, the dtype's minimum
    elsewhere (a padding query reads itself, so that no row is empty).

    With ``queries`` (long ``[B, M]``, query positions): that mask's rows at those positions, ``[B, 1, M, T]``."""
    keys = torch.arange(length, device=device)
    rows = keys.expand(batch, length) if queries is None else queries.to(device)  # [B, M]
    allowed = keys <= rows[..., None]  # [B, M, T]
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
        allowed = allowed | (keys == rows[..., None])
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def loss_slots(at: tuple[torch.Tensor, torch.Tensor], batch: int, length: int) -> tuple[torch.Tensor, ...]:
    """The compact unroll's layout of the positions ``at = (b, t)`` (``[M]`` long each, any order, repeats allowed):
    each sequence's distinct positions in increasing order, padded to the longest.

    Returns:
        ``(queries [B, Mmax] long, (b, j) [M] long each)``: ``queries[b, :n_b]`` the n_b positions of sequence b
        (the padding slots repeat position T - 1, computed and never read), and the slot ``j`` of each ``at`` entry,
        so that ``y[b, j]`` of a ``[B, Mmax, ...]`` tensor is position ``(b, t)``.
    """
    b, t = at
    chosen = torch.zeros(batch, length, dtype=torch.bool, device=t.device)
    chosen[b, t] = True
    width = int(chosen.sum(1).max()) if batch else 0
    ranked = torch.where(chosen, torch.arange(length, device=t.device), length).sort(dim=1).values
    queries = ranked[:, :width].clamp(max=length - 1)
    return queries, (b, chosen.cumsum(1)[b, t] - 1)


def _rotate(t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on queries or keys ``t [B, heads, T, d]`` with ``rope = (cos, sin)`` ``[B, T, d]``: transformers'
    ``apply_rotary_pos_emb`` (Llama) for one tensor, the same operations in the same order."""
    cos, sin = (r.unsqueeze(1) for r in rope)
    return t * cos + rotate_half(t) * sin


def _rows(x: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``x [B, T, C]`` at the positions ``queries [B, M]`` -> ``[B, M, C]``."""
    return x.gather(1, queries[..., None].expand(-1, -1, x.shape[-1]))


def eagle3_target_fields(config: Any, feature_layers: Any = None) -> dict[str, Any]:
    """The :class:`Eagle3Spec` fields a target's config gives (its attention and MLP shape, RoPE, and vLLM's default
    feature layers ``(2, L // 2, L - 3)`` unless ``feature_layers`` is given).

    Raises:
        ValueError: the target is too shallow for three distinct default taps (from
            :func:`medusa_train.models.features.default_eagle3_layers`).
    """
    from medusa_train.models.features import check_feature_layers, count_layers, default_eagle3_layers

    text = getattr(config, "get_text_config", lambda: config)()
    num_layers = count_layers(text)
    try:
        layers = default_eagle3_layers(num_layers) if feature_layers is None else tuple(feature_layers)
    except ValueError as e:
        raise ValueError(f"heads.feature_layers=null (vLLM's default taps): {e}: give three distinct indices "
                         f"0..{num_layers - 1} in heads.feature_layers (layer {num_layers} is read after the final "
                         "norm here, before it in vLLM)") from None
    check_feature_layers(layers, num_layers, "heads.feature_layers")
    heads = int(getattr(text, "num_attention_heads"))
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    return dict(feature_layers=layers, num_attention_heads=heads,
                num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
                intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
                rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-5)), rope_theta=float(theta),
                max_position_embeddings=int(getattr(text, "max_position_embeddings", 8192)))


def eagle3_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None,
                  project_fn: ProjectFn | None = None) -> Any:
    """The training-time test's steps, teacher forced (:meth:`Eagle3Drafter.unroll`), over whole sequences: the
    inputs' features and path tokens ``[B, T, ...]`` -> ``[K', B, T, V']``, or ``[K', M, V']`` at
    ``inputs.positions`` (with ``project_fn``: its result on the steps' features and the lm_head weight)."""
    spec = getattr(heads, "module", heads).spec
    taps = [inputs.features[layer_feature(i)] for i in spec.feature_layers]
    steps = spec.num_heads if num_heads is None else num_heads
    with torch.no_grad():
        path_embeds = inputs.embed(inputs.path_tokens[..., :steps])  # [B, T, K', H], frozen
    return heads(None, None, None, unroll=dict(taps=taps, path_embeds=path_embeds, num_steps=steps,
                                                attention_mask=inputs.attention_mask, at=inputs.positions,
                                                project_fn=project_fn))


def eagle3_features(spec: Eagle3Spec) -> tuple[str, ...]:
    """The target features an EAGLE-3 drafter reads: its three layers' (and the final state, for the targets)."""
    return (FINAL, *(layer_feature(i) for i in spec.feature_layers))


__all__ = ["Eagle3Attention", "Eagle3Drafter", "Eagle3Layer", "Eagle3Spec", "eagle3_features", "eagle3_logits",
           "eagle3_target_fields", "loss_slots", "unrolled_context_mask"]
