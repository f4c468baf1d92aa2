"""Key layouts of Medusa head checkpoints, and the mapping between them and our stacked parameters.

The ``medusa`` layout's heads (:class:`~medusa_train.drafters.medusa.heads.MedusaHeads`) store
``block_weight [K, L, H, H]``, ``block_bias [K, L, H]`` and ``lm_head_weight [K, V', H]``; engines store one tensor
per head and layer under their own names:

- FasterDecoding Medusa (``medusa/model/medusa_model.py`` at 60eeab9): head ``h`` is
  ``nn.Sequential(ResBlock * L, nn.Linear(H, V, bias=False))`` with ``ResBlock.linear = nn.Linear(H, H)``, so its
  ``state_dict`` keys are ``{h}.{l}.linear.weight|bias`` and ``{h}.{L}.weight``. Text Generation Inference reads the
  same names (``layers/medusa.py``), and falls back to the base lm_head when no ``{h}.{L}.weight`` exists (one
  layer only). FasterDecoding builds a head's L blocks by list multiplication, so its own module shares one block
  across layers: it reproduces exports with ``medusa_num_layers == 1`` only (with more, the last layer's weights
  land in every block); TGI and :func:`~medusa_train.export.load_heads` keep the layers distinct.
- vLLM (``vllm/model_executor/models/medusa.py`` at 09cddad): ``blocks.{h}.layers.{l}.weight|bias`` (bias only with
  ``medusa_fc_bias``) and ``lm_heads.{h}.weight``; with ``original_lm_head`` a single ``lm_heads.0.weight`` serves
  every head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from medusa_train.models.heads_base import HeadsSpec


@dataclass(frozen=True)
class Layout:
    """Name patterns of one checkpoint layout (``str.format`` fields: ``h`` head, ``l`` layer, ``L`` layers)."""

    name: str
    block_weight: str
    block_bias: str
    projection: str


FASTERDECODING = Layout("FasterDecoding", "{h}.{l}.linear.weight", "{h}.{l}.linear.bias", "{h}.{L}.weight")
VLLM = Layout("vLLM", "blocks.{h}.layers.{l}.weight", "blocks.{h}.layers.{l}.bias", "lm_heads.{h}.weight")


def expected_shapes(
    layout: Layout, spec: HeadsSpec, projections: int, with_bias: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every key a checkpoint of ``spec`` holds in ``layout``, with its shape.

    Args:
        layout: the naming scheme.
        spec: shape of the heads.
        projections: how many ``[V', H]`` projections the file holds (K, 1 for vLLM's ``original_lm_head``, or 0).
        with_bias: whether the residual blocks store a bias (vLLM's ``medusa_fc_bias``).
    """
    K, L, H = spec.num_heads, spec.num_layers, spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for h in range(K):
        for l in range(L):
            shapes[layout.block_weight.format(h=h, l=l)] = (H, H)
            if with_bias:
                shapes[layout.block_bias.format(h=h, l=l)] = (H,)
    for h in range(projections):
        shapes[layout.projection.format(h=h, L=L)] = (spec.out_size, H)
    return shapes


def split_heads(heads: nn.Module, layout: Layout, projections: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-head, per-layer tensors of ``heads`` under ``layout``'s names, on CPU, contiguous, sharing no storage.

    Args:
        heads: the stacked heads of the ``medusa`` layout (``block_weight``, ``block_bias``, ``lm_head_weight``);
            tensors keep their dtype.
        layout: the naming scheme.
        projections: ``[P, V', H]`` projections to write as heads ``0..P-1``; defaults to ``heads.lm_head_weight``
            (none when ``share_lm_head``).

    Returns:
        name -> tensor; safetensors refuses tensors that share storage, hence one copy per entry.
    """
    spec = heads.spec
    out: dict[str, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True).contiguous()

    for h in range(spec.num_heads):
        for l in range(spec.num_layers):
            out[layout.block_weight.format(h=h, l=l)] = copy(heads.block_weight[h, l])
            out[layout.block_bias.format(h=h, l=l)] = copy(heads.block_bias[h, l])
    if projections is None:
        projections = heads.lm_head_weight
    if projections is not None:
        for h in range(projections.shape[0]):
            out[layout.projection.format(h=h, L=spec.num_layers)] = copy(projections[h])
    return out


def stack_heads(
    state: dict[str, torch.Tensor], layout: Layout, spec: HeadsSpec, with_bias: bool = True
) -> dict[str, torch.Tensor]:
    """The ``medusa`` layout heads' state dict (``block_weight``, ``block_bias``, ``lm_head_weight``) from ``layout``
    keys.

    Keys and shapes must already have been checked against :func:`expected_shapes`. Without a stored bias the
    blocks get a zero bias (``x + SiLU(W x)`` is the same block). ``lm_head_weight`` is present unless
    ``spec.share_lm_head``. ``token_map`` is not included.
    """
    K, L = spec.num_heads, spec.num_layers
    weight = torch.stack([torch.stack([state[layout.block_weight.format(h=h, l=l)] for l in range(L)])
                          for h in range(K)])
    if with_bias:
        bias = torch.stack([torch.stack([state[layout.block_bias.format(h=h, l=l)] for l in range(L)])
                            for h in range(K)])
    else:
        bias = torch.zeros(K, L, spec.hidden_size, dtype=weight.dtype)
    stacked = {"block_weight": weight, "block_bias": bias}
    if not spec.share_lm_head:
        stacked["lm_head_weight"] = torch.stack([state[layout.projection.format(h=h, L=L)] for h in range(K)])
    return stacked


def check_keys_and_shapes(
    state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str, hint: str = ""
) -> None:
    """Strict check of a loaded checkpoint before anything is copied.

    Raises:
        ValueError: listing every missing and unexpected key (plus ``hint``), or every wrong shape, with ``source``.
    """
    missing = sorted(set(expected) - set(state), key=_natural)
    unexpected = sorted(set(state) - set(expected), key=_natural)
    if missing or unexpected:
        raise ValueError(
            f"{source}: keys do not match the config: missing keys {missing}, unexpected keys {unexpected}"
            + (f"; {hint}" if hint else "")
        )
    wrong = [f"{k}: file {tuple(state[k].shape)}, expected {shape}"
             for k, shape in sorted(expected.items(), key=lambda kv: _natural(kv[0]))
             if tuple(state[k].shape) != shape]
    if wrong:
        raise ValueError(f"{source}: tensor shapes do not match the config: {'; '.join(wrong)}")
    not_float = sorted(k for k, t in state.items() if not t.is_floating_point())
    if not_float:
        raise ValueError(f"{source}: weights must be floating point, got {[(k, state[k].dtype) for k in not_float]}")


def fasterdecoding_limitation(spec: HeadsSpec) -> str | None:
    """Why FasterDecoding's own ``MedusaModel`` cannot reproduce heads of ``spec`` (None when it can).

    Its head is ``nn.Sequential(ResBlock * L, nn.Linear(H, V))``: one block object repeated L times and a projection
    over the full vocabulary, with no token map.
    """
    if spec.head_vocab_size is not None:
        return (f"a reduced head vocabulary (head_vocab_size={spec.head_vocab_size} of {spec.vocab_size}) needs the "
                "token map, which FasterDecoding and TGI do not read")
    if spec.num_layers > 1:
        return (f"medusa_num_layers={spec.num_layers}: FasterDecoding builds a head's blocks by list multiplication, "
                "so its model holds one block per head and would load the last layer's weights into every layer")
    return None


def tgi_limitation(spec: HeadsSpec) -> str | None:
    """Why Text Generation Inference cannot serve heads of ``spec`` (None when it can).

    TGI (``server/text_generation_server/layers/medusa.py``) reads ``medusa_lm_head.safetensors`` with one projection
    per head over the full vocabulary (``MedusaHeadV1``), or, when the projections are absent, projects every head
    with the base lm_head and takes one-layer heads only (``MedusaHeadV2``); it reads no token map.
    """
    if spec.head_vocab_size is not None:
        return (f"a reduced head vocabulary (head_vocab_size={spec.head_vocab_size} of {spec.vocab_size}) needs the "
                "token map, which TGI does not read")
    if spec.share_lm_head and spec.num_layers > 1:
        return (f"share_lm_head with medusa_num_layers={spec.num_layers}: TGI projects with the base lm_head only for "
                "one-layer heads")
    return None


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Raise ``ValueError`` naming every floating-point tensor of ``state`` that holds NaN or Inf, with its head.

    Keys are those of a checkpoint layout (``{h}.{l}.linear.weight``, ``blocks.{h}.layers.{l}.weight``, ...); the
    head is the first integer in the key.
    """
    bad = []
    for key in sorted(state, key=_natural):
        tensor = state[key]
        if not tensor.is_floating_point():
            continue
        finite = torch.isfinite(tensor)
        if bool(finite.all()):
            continue
        nan = int(torch.isnan(tensor).sum())
        inf = tensor.numel() - int(finite.sum()) - nan
        head = next((part for part in key.split(".") if part.isdigit()), "?")
        bad.append(f"{key} (head {head}): {nan} NaN and {inf} Inf of {tensor.numel()} values")
    if bad:
        shown = "; ".join(bad[:6]) + (f"; and {len(bad) - 6} more tensors" if len(bad) > 6 else "")
        raise ValueError(f"{source}: the heads hold non-finite weights ({shown}). Heads like these decode garbage: "
                         "training diverged or a checkpoint is damaged; export an earlier checkpoint or retrain")


def _natural(key: str) -> list[object]:
    """Sort key ordering ``2.x`` before ``10.x``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]
