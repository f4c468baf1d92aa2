"""A target model's named features: the one function that training, the training cache, tuning and decoding call to
run the target and read what a drafter declares it needs.

Names:
    :data:`FINAL` (``"final"``): the last hidden state after the final norm, what the lm_head reads, ``[B, T, H]``.
    ``layer{i}`` (:func:`layer_feature`): transformers' ``output_hidden_states[i]``, ``[B, T, H]``: the residual
    stream at the INPUT of decoder layer ``i``. ``layer0`` is the embeddings' output (with GPT-2 the token plus
    position embeddings, with Gemma the scaled ones), ``layer{i}`` for ``0 < i < L`` the output of layer ``i - 1``.
    ``layer{L}`` (L = the number of decoder layers) is, as in transformers for every family we support, the last
    layer's output AFTER the final norm, so it equals :data:`FINAL`.

This is the convention of vLLM's EAGLE-3 targets (read in vLLM 0.32.0): ``LlamaModel.forward`` in
``vllm/model_executor/models/llama.py`` offers the embeddings to ``EagleModelMixin._maybe_add_hidden_state``
(``vllm/model_executor/models/interfaces.py``) as index ``start_layer`` before the loop, and after decoder layer
``idx`` offers ``hidden_states + residual`` as index ``idx + 1``, i.e. the input of layer ``idx + 1``; its
transformers backend (``vllm/model_executor/models/transformers/base.py``, ``set_aux_hidden_state_layers``) records
the output of layer ``i - 1`` for tap ``i``. One difference, at ``i = L`` only: vLLM's tap ``L`` is the last layer's
output BEFORE the final norm, ours (transformers') after it. vLLM's default taps
(``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``: :func:`default_eagle3_layers`) never reach ``L``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

FINAL = "final"
_LAYER = re.compile(r"layer(\d+)")


def layer_feature(i: int) -> str:
    """The name of the feature at the input of decoder layer ``i`` (``output_hidden_states[i]``): ``layer{i}``."""
    return f"layer{i}"


def feature_layer(name: str) -> int | None:
    """The layer index of a feature name: ``"layer3"`` -> 3, :data:`FINAL` -> None.

    Raises:
        ValueError: neither :data:`FINAL` nor ``layer{i}`` (i a non-negative integer).
    """
    if name == FINAL:
        return None
    match = _LAYER.fullmatch(name)
    if match is None:
        raise ValueError(f"unknown target feature {name!r}: use {FINAL!r} (the last hidden state after the final "
                         "norm) or 'layer<i>' (the input of decoder layer i, 0 = the embeddings' output)")
    return int(match.group(1))


def count_layers(config: Any) -> int:
    """The number of decoder layers L of a transformers config: ``num_hidden_layers`` (GPT-2 maps it to ``n_layer``;
    a multimodal config's text part is read).

    Raises:
        ValueError: the config names no layer count.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_hidden_layers", "n_layer"):
        value = getattr(text, key, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot tell the number of layers of {type(config).__name__}: it has no num_hidden_layers")


def check_feature_layers(layers: Sequence[int], num_layers: int,
                         field: str = "heads.feature_layers") -> tuple[int, ...]:
    """``layers`` as a tuple of ints after checking each is a layer index of a target with ``num_layers`` decoder
    layers, ``0 <= i <= num_layers`` (see the module docstring for what each index reads).

    Raises:
        ValueError: naming ``field``: an index that is not an integer, out of range, or repeated.
    """
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"{field}: layer index {i!r} is not an integer; give indices 0..{num_layers}")
        if not 0 <= i <= num_layers:
            raise ValueError(f"{field}: layer {i} is out of range for a target with {num_layers} layers; give indices "
                             f"0..{num_layers} (0 = the embeddings' output, {num_layers} = the last layer's output "
                             "after the final norm)")
        if i in out:
            raise ValueError(f"{field}: layer {i} is given twice; give each index once")
        out.append(i)
    return tuple(out)


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 taps of a target with ``num_layers`` decoder layers: ``(2, L // 2, L - 3)`` (vLLM
    0.32.0, ``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`` in
    ``vllm/model_executor/models/interfaces.py``), in this module's indexing (the same as vLLM's below L).

    Raises:
        ValueError: ``num_layers`` < 7, where the three taps are not distinct and increasing (vLLM would keep fewer
            than three, or read no layer at all for a negative index).
    """
    taps = (2, num_layers // 2, num_layers - 3)
    if not taps[0] < taps[1] < taps[2]:
        raise ValueError(f"vLLM's default EAGLE-3 taps (2, L // 2, L - 3) = {taps} are not three distinct layers of "
                         f"a target with L = {num_layers} layers (it needs at least 7); name the layers explicitly")
    return taps


def target_features(backbone: nn.Module, input_ids: torch.Tensor, layers: Sequence[int] = (),
                    **backbone_kwargs: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Run the target's backbone (``base.base_model``) once and return its named features.

    Args:
        backbone: the transformers base model (its ``last_hidden_state`` is after the final norm).
        input_ids: ``[B, T]`` long.
        layers: the ``layer{i}`` features wanted (see the module docstring); empty (the default): only
            :data:`FINAL`, and the backbone is not asked for its hidden states (no extra memory or time).
        backbone_kwargs: passed on (``attention_mask``, ``position_ids``, ``cache``, ``use_cache``, ...).

    Returns:
        ``({FINAL: [B, T, H], "layer{i}": [B, T, H] for i in layers}, cache)``, in the backbone's dtype; ``cache``
        is the backbone's returned key-value cache (``cache``, or ``past_key_values`` in older transformers), or None.

    Raises:
        ValueError: a layer index outside ``0..L`` (the field named ``layers``).
    """
    if layers:
        layers = check_feature_layers(layers, count_layers(backbone.config), field="layers")
        backbone_kwargs = {**backbone_kwargs, "output_hidden_states": True}
    out = backbone(input_ids=input_ids, return_dict=True, **backbone_kwargs)
    features = {FINAL: out.last_hidden_state}
    for i in layers:
        features[layer_feature(i)] = out.hidden_states[i]
    cache = out.get("cache", None)
    return features, cache if cache is not None else out.get("past_key_values", None)
