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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from medusa_train.drafters.catalog import DrafterType, TargetInputs, register
from medusa_train.features import FINAL, layer_feature
from medusa_train.heads import HeadsSpec, register_token_map


@dataclass(frozen=True)
class Eagle3Spec(HeadsSpec):
    """Shape of an EAGLE-3 drafter: :class:`~medusa_train.heads.HeadsSpec` (``num_heads``: K, the draft steps the
    training-time test unrolls; ``num_layers``: 1, the one decoder layer vLLM reads; ``head_vocab_size``: the draft
    vocabulary) plus the decoder layer's shape, taken from the target's config.

    Attributes:
        feature_layers: the target layers fused by ``fc`` (:mod:`medusa_train.features` indices: the input of layer
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
            raise ValueError(f"EAGLE-3 drafters have one decoder layer (heads.medusa_num_layers=1, what vLLM reads), "
                             f"got {self.num_layers}")
        if self.share_lm_head:
            raise ValueError("heads.share_lm_head=true: an EAGLE-3 drafter projects with its own lm_head over the "
                             "draft vocabulary (vLLM loads it from the export); set heads.share_lm_head=false")
        if len(self.feature_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers (low, middle, high), got feature_layers="
                             f"{list(self.feature_layers)}")
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
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # [B, heads, T, d]
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, 0)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and cache is None)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


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
        self.rotary = LlamaRotaryEmbedding(spec.layer_config())
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

    def fuse(self, taps: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target features of :attr:`Eagle3Spec.feature_layers` (each ``[..., H]``, in that order) -> the fused
        feature ``[..., H]`` (``fc`` over their concatenation)."""
        return self.fc(torch.cat([t.to(self.dtype) for t in taps], dim=-1))

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step at T positions.

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
        layer = self.midlayer
        hidden, embeds = hidden.to(self.dtype), embeds.to(self.dtype)
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        rope = self.rotary(x, position_ids)
        s = layer.self_attn(x, rope, mask, cache) + residual
        out = layer.mlp(layer.post_attention_layernorm(s)) + s
        return self.lm_head(self.norm(out)), out


def eagle3_target_fields(config: Any, feature_layers: Any = None) -> dict[str, Any]:
    """The :class:`Eagle3Spec` fields a target's config gives (its attention and MLP shape, RoPE, and vLLM's default
    feature layers ``(2, L // 2, L - 3)`` unless ``feature_layers`` is given).

    Raises:
        ValueError: the target is too shallow for three distinct default taps (from
            :func:`medusa_train.features.default_eagle3_layers`).
    """
    from medusa_train.features import check_feature_layers, count_layers, default_eagle3_layers

    text = getattr(config, "get_text_config", lambda: config)()
    num_layers = count_layers(text)
    layers = default_eagle3_layers(num_layers) if feature_layers is None else tuple(feature_layers)
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




def _eagle3_logits(heads: nn.Module, inputs: TargetInputs, num_heads: int | None) -> torch.Tensor:
    """The training-time test's K steps, teacher forced (see :mod:`medusa_train.training.eagle3_ttt`)."""
    raise NotImplementedError("EAGLE-3 training-time test logits: being built (issue 30)")


def _eagle3_features(spec: Eagle3Spec) -> tuple[str, ...]:
    """The target features an EAGLE-3 drafter reads: its three layers' (and the final state, for the targets)."""
    return (FINAL, *(layer_feature(i) for i in spec.feature_layers))


EAGLE3 = register(DrafterType(
    name="eagle3", title="EAGLE-3", spec_cls=Eagle3Spec, module_cls=Eagle3Drafter, logits=_eagle3_logits,
    source="Li et al. 2025, EAGLE-3, arXiv:2503.01840, Sec. 3",
    features_of=_eagle3_features, target_fields=lambda config, options: eagle3_target_fields(
        config, options.get("feature_layers")),
    options=("feature_layers",), reads_path=True, weights_file="eagle3_drafter.safetensors",
    config_keys={"num_heads": "eagle3_num_steps", "feature_layers": "eagle3_feature_layers",
                 "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
                 "head_dim": "head_dim", "intermediate_size": "intermediate_size", "rms_norm_eps": "rms_norm_eps",
                 "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings"},
    engines={"fasterdecoding": "EAGLE-3 drafters have no FasterDecoding form (FasterDecoding loads Medusa heads)",
             "tgi": "EAGLE-3 drafters have no TGI layout here",
             "vllm": None},
    engine_writers={"vllm": "medusa_train.export.speculators:speculators_writer"},  # speculators/, not vllm/
    tree_drafter=None,
))


__all__ = ["EAGLE3", "Eagle3Attention", "Eagle3Drafter", "Eagle3Layer", "Eagle3Spec", "eagle3_target_fields"]
