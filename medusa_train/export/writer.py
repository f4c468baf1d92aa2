"""Write trained heads as an export folder that FasterDecoding, Text Generation Inference and vLLM read.

Layout:

```
export/
  config.json                  medusa_num_heads, medusa_num_layers, hidden_size, vocab_size,
                               base_model_name_or_path, share_lm_head, version (+ head_vocab_size, torch_dtype, ...)
  medusa_lm_head.safetensors   "{h}.{l}.linear.weight|bias", "{h}.{L}.weight" (no projection with share_lm_head)
  medusa_lm_head.pt            the same keys, torch.save of a plain dict: what FasterDecoding's loader reads
  token_map.safetensors        "token_map" [V'] int64, only with a reduced head vocabulary
  vllm/config.json             vLLM MedusaConfig (model_type "medusa", medusa_fc_bias true)
  vllm/model.safetensors       "blocks.{h}.layers.{l}.weight|bias", "lm_heads.{h}.weight" [V, H]
                               (+ "medusa_train.token_map" with a reduced head vocabulary; vLLM ignores it)
```

``medusa_lm_head.pt`` is for FasterDecoding's ``MedusaModel.from_pretrained`` (v0.1 and its GitHub head read only
that name, with ``torch.load`` and ``load_state_dict(strict=False)``). It is written only when FasterDecoding's model
can reproduce the heads (:func:`~medusa_train.export.layouts.fasterdecoding_limitation`: full vocabulary, one block
per head), and removed otherwise. With ``share_lm_head`` it holds every head's projection too, as the base lm_head
(one storage referenced by K keys, so the file holds one copy): FasterDecoding's model has a projection per head and
its GitHub head leaves a missing one randomly initialised. The ``.safetensors`` file stays the compact one (TGI and
:func:`load_heads` read it). vLLM's Medusa cannot reach the target model's lm_head either, so ``vllm/`` stores the
base lm_head once as ``lm_heads.0.weight`` with ``original_lm_head: true``. Both are why ``share_lm_head`` needs
``base_model``.

Drafter types with the ``state_dict`` layout (:mod:`medusa_train.models.catalog`; Hydra heads) have no engine
layout here: their folder holds ``config.json`` (``head_type``, see :mod:`~medusa_train.export.configs`), the type's
``weights_file`` (the module's own parameter names; Hydra: ``hydra_heads.safetensors`` with
``heads.{k}.residual.weight``, ``heads.{k}.layers.{l}.weight|bias``, ``lm_head_weight [K, V', H]``) and
``token_map.safetensors`` with a reduced vocabulary; ``vllm=True`` is refused with the type's reason (vLLM's Medusa
would read them as Medusa heads), and the files of other types left by an earlier export into the folder are removed,
so no loader finds heads of another kind there.

A type with its own engine files (``DrafterType.engine_writers``) gets them instead of ``vllm/`` when ``vllm=True``:
EAGLE-3 drafters write ``speculators/`` (``config.json``, ``model.safetensors``), what vLLM serves with
``method: eagle3`` (:mod:`medusa_train.drafters.eagle3.speculators`, which refuses a tensor vLLM would not load, by
name, before anything is written). Engines read those files themselves, not through our reader, so config.json
records each one's sha256 (``engine_files_sha256``: ``{"speculators/model.safetensors": hex, ...}``), which is
checked before they are served or converted.

Heads holding NaN or Inf are refused before anything is written.

``vllm/`` is what vLLM 0.32 loads (``vllm/model_executor/models/medusa.py``), whose Medusa proposes each head's
top-1 token over the full vocabulary: its per-head ``lm_heads`` must have all V rows (a V'-row head asserts in
``ParallelLMHead.weight_loader``), and a ``token_map`` tensor stops the load ("Following weights were not
initialized from checkpoint: {'token_map'}": it becomes a parameter only inside ``load_weights``). A reduced head
vocabulary (V' < V, ``token_map``) is therefore written as full-vocabulary projections (:func:`vllm_projections`):
the V' rows of the token map hold the head's own rows, and every other row holds the mean of those V' rows. That
token's logit is then the mean of the head's V' logits, never above their maximum (equal only when all V' logits
are equal), so vLLM's argmax over V tokens is the head's own top-1 over V': exactly our draft (the V' rows are
stored unchanged; vLLM running in a lower dtype than the export's rounds the mean row too, which can matter only
where the head's V' logits all lie within rounding of each other). Zero rows instead give logit 0, which beats every in-map token wherever the head's
V' logits are all negative; rows from the base lm_head compete with the head's own rows. ``docs/vllm.md`` has both
measured. The cost is size: K x V x H instead of K x V' x H (SmolLM2-135M, K = 4, V' = 4,096, fp32: 458 MB
instead of 43 MB; one V x H matrix with ``share_lm_head``). :func:`vllm_problem` names the layouts vLLM cannot
reproduce; :func:`save_export` refuses them before writing anything.

The folder is written whole beside the old one and swapped in
(:func:`~medusa_train.export.folder_swap.replace_folder`): a write that fails at any point (a full disk while
``vllm/model.safetensors`` is written) leaves the previous export as it was, never new heads beside an old
``config.json`` or ``vllm/``. What other commands wrote into the old folder is carried over into the new one, as
re-exporting into the folder always kept it: ``medusa_choices.json``, ``head_accuracy.json``,
``latency_profile.json`` (``medusa-tune-tree``; a re-export keeps the tuned tree, and ``medusa-eval`` notices the
new heads by their checksum), ``README.md``, ``base/``, ``train_head_accuracy.json``, an ``eval/`` folder. Files of
ours (:func:`owned_files`) that the new export does not have (a stale ``token_map.safetensors``, ``vllm/`` when
``vllm=False``, the heads of the other kind) are not carried over. The export folder's lock is held while it is
written: an export is refused while ``medusa-tune-tree`` tunes the folder. Files get the permissions ``open()``
gives (``0o666`` less the umask).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from medusa_train.export.configs import ENGINE_SHA256_KEY, VLLM_TOKEN_MAP, export_config, vllm_config
from medusa_train.export.files import sha256_files, write_json, write_safetensors, write_torch
from medusa_train.export.folder_swap import replace_folder
from medusa_train.export.layouts import FASTERDECODING, VLLM, check_finite, fasterdecoding_limitation, split_heads
from medusa_train.models.catalog import MEDUSA_LAYOUT, drafter_types, type_of
from medusa_train.models.speculative import DraftHeads, check_heads_match_base

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"
LEGACY_WEIGHTS_FILE = "medusa_lm_head.pt"
TOKEN_MAP_FILE = "token_map.safetensors"
VLLM_DIR = "vllm"
VLLM_WEIGHTS_FILE = "model.safetensors"


def weights_files() -> tuple[str, ...]:
    """The heads' weights file of every registered drafter type (Medusa's ``medusa_lm_head.safetensors`` first)."""
    return (WEIGHTS_FILE, *(e.weights_file for e in drafter_types() if e.weights_file))


def owned_files() -> tuple[str, ...]:
    """Every path save_export writes for any drafter type (relative to the export folder), the types' engine files
    included (``DrafterType.engine_files``): never carried over from an earlier export."""
    return (CONFIG_FILE, *weights_files(), LEGACY_WEIGHTS_FILE, TOKEN_MAP_FILE, f"{VLLM_DIR}/{VLLM_WEIGHTS_FILE}",
            f"{VLLM_DIR}/{CONFIG_FILE}", *(f for e in drafter_types() for f in e.engine_files))


def save_export(
    heads: DraftHeads,
    out_dir: str | os.PathLike[str],
    base_model_name_or_path: str,
    extra_config: dict[str, Any] | None = None,
    vllm: bool = True,
    *,
    base_model: PreTrainedModel | None = None,
    fasterdecoding: bool = True,
    write_also: Callable[[Path], None] | None = None,
    also_owns: Collection[str] = (),
) -> Path:
    """Export ``heads`` into ``out_dir`` (created if needed), replacing an earlier export there whole and keeping
    what other commands wrote into it (see the module docstring).

    Weights are written in the heads' own dtype (``torch_dtype`` in config.json), as one contiguous CPU tensor per
    head and layer.

    Args:
        heads: the trained heads (``block_weight [K, L, H, H]``, ``block_bias [K, L, H]``, ``lm_head_weight
            [K, V', H]`` or none with ``share_lm_head``, ``token_map [V']`` with a reduced vocabulary), or heads of
            another drafter type (:class:`~medusa_train.drafters.hydra.heads.HydraHeads`, ...; see the module
            docstring).
        out_dir: the export folder.
        base_model_name_or_path: Hub id or path of the base model, recorded for loaders (FasterDecoding, TGI).
        extra_config: more JSON-serialisable fields for config.json (never one of the fields written here).
        vllm: also write ``vllm/`` (or the type's own vLLM files, e.g. an EAGLE-3 drafter's ``speculators/``).
        base_model: the base ``*ForCausalLM``; checked against the heads and its class recorded. Required with
            ``share_lm_head`` when ``vllm`` or ``medusa_lm_head.pt`` is written (its lm_head goes into them).
        fasterdecoding: also write ``medusa_lm_head.pt`` for FasterDecoding's loader (when it can reproduce the
            heads, see the module docstring).
        write_also: writes more of this export's own content into the new folder before it is swapped in (a
            Medusa-2 export's fine-tuned ``base/``, the training's accuracy table), so that it is replaced with the
            heads, as one set.
        also_owns: paths (relative to ``out_dir``) that ``write_also`` owns: an earlier export's copies are never
            carried over, whether or not it writes them again.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: heads holding NaN or Inf (tensor and head named); ``extra_config`` clashes with a written field
            or is not JSON-serialisable; ``share_lm_head`` with ``vllm`` or ``medusa_lm_head.pt`` but without
            ``base_model``; ``vllm`` with heads vLLM cannot serve (Hydra heads), or for heads vLLM cannot reproduce (:func:`vllm_problem`, the
            reason given), or whose tensors vLLM would not load as written (the type's engine writer, tensor
            named); ``base_model`` does not match the heads (field named). All before anything is written.
        LockHeldError: another process holds the export folder (a ``medusa-tune-tree`` run, or another export into
            it), named; nothing is written.
        OSError: writing failed (e.g. the disk is full); the previous export is left as it was.
    """
    spec = heads.spec
    out = Path(out_dir)
    entry = type_of(heads)
    medusa_layout = entry.layout == MEDUSA_LAYOUT
    vllm_reason = entry.engine_problem("vllm")
    if vllm_reason is not None and vllm:
        raise ValueError(f"vllm=True: {vllm_reason} and these are {entry.title} heads (head_type {entry.name!r}); "
                         "pass vllm=False (export_vllm=false)")
    engine_writer = entry.engine_writer("vllm") if vllm else None
    problem = vllm_problem(spec.head_vocab_size) if vllm and engine_writer is None else None
    if problem is not None:
        raise ValueError(f"cannot write vllm/ for these heads: {problem}; export with vllm=False (export_vllm=false) "
                         "to skip it")
    if medusa_layout:
        tensors = split_heads(heads, FASTERDECODING)
        fd_reason = fasterdecoding_limitation(spec) if fasterdecoding else "fasterdecoding=False"
        weights_file = WEIGHTS_FILE
    else:
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in heads.state_dict().items()
                   if k != "token_map"}
        fd_reason = entry.engine_problem("fasterdecoding")
        weights_file = entry.weights_file
    check_finite(tensors, f"refusing to export to {out}")
    if spec.share_lm_head and base_model is None and (vllm or fd_reason is None):
        raise ValueError("share_lm_head=True: vLLM's Medusa and FasterDecoding's loader cannot use the target "
                         "model's lm_head, so vllm/ and medusa_lm_head.pt hold a copy; pass base_model=... to "
                         "save_export, or vllm=False and fasterdecoding=False to write neither")
    if base_model is not None:
        check_heads_match_base(spec, base_model)
    write_engine = None if engine_writer is None else engine_writer(
        heads, base_model_name_or_path=base_model_name_or_path, base_model=base_model)
    dtype = heads.block_weight.dtype if medusa_layout else heads.dtype
    config = export_config(
        spec, base_model_name_or_path, dtype,
        base_model_class=None if base_model is None else type(base_model).__name__,
        base_model_type=None if base_model is None else getattr(base_model.config, "model_type", None),
        extra_config=extra_config,
    )
    try:
        json.dumps(config)
    except TypeError as e:
        raise ValueError(f"extra_config must be JSON-serialisable: {e}") from e
    if out.exists() and not out.is_dir():
        raise ValueError(f"export folder {out} exists and is not a folder")

    token_map = None if heads.token_map is None else heads.token_map.detach().to("cpu", copy=True).contiguous()
    stale_fasterdecoding = fd_reason is not None and (out / LEGACY_WEIGHTS_FILE).exists()

    def write(folder: Path) -> None:
        record = config
        write_safetensors(folder / weights_file, tensors)
        if fd_reason is None:
            write_torch(folder / LEGACY_WEIGHTS_FILE, _fasterdecoding_state(heads, tensors, base_model))
        if token_map is not None:
            write_safetensors(folder / TOKEN_MAP_FILE, {"token_map": token_map})
        if write_engine is not None:
            write_engine(folder)
            record = {**config, ENGINE_SHA256_KEY: {name: sha256_files([folder / name])
                                                    for name in entry.engine_files if (folder / name).is_file()}}
        elif vllm:
            base_lm_head = None if base_model is None else base_model.get_output_embeddings().weight
            _write_vllm(heads, folder / VLLM_DIR, token_map, base_lm_head if spec.share_lm_head else None)
        write_json(folder / CONFIG_FILE, record)
        if write_also is not None:
            write_also(folder)

    replace_folder(out, write, (*owned_files(), *also_owns))
    if stale_fasterdecoding:
        log.info("removed %s of the earlier export: FasterDecoding cannot load these heads (%s)",
                 out / LEGACY_WEIGHTS_FILE, fd_reason)
    return out


def _fasterdecoding_state(
    heads: DraftHeads, tensors: dict[str, torch.Tensor], base_model: PreTrainedModel | None
) -> dict[str, torch.Tensor]:
    """``medusa_lm_head.pt``'s state dict: ``tensors`` (FasterDecoding keys), plus with ``share_lm_head`` the base
    lm_head ``[V, H]`` in the heads' dtype as every head's ``{h}.{L}.weight`` (one tensor under K keys)."""
    if not heads.spec.share_lm_head:
        return tensors
    weight = base_model.get_output_embeddings().weight.detach().to("cpu", heads.block_weight.dtype, copy=True)
    L = heads.spec.num_layers
    return {**tensors, **{FASTERDECODING.projection.format(h=h, L=L): weight for h in range(heads.spec.num_heads)}}
def vllm_problem(head_vocab_size: int | None) -> str | None:
    """Why vLLM's Medusa cannot reproduce heads with this head vocabulary (None: it can; see the module docstring).

    vLLM drafts each head's top-1 token with one projection per head (or one shared), no bias, over all V tokens.
    Heads whose top-1 no such projection reproduces are refused: a one-token head vocabulary (every other token
    ties with it, and vLLM's argmax takes the lowest id). Checked by :func:`save_export` and, before training, by
    ``TrainConfig.validate``.
    """
    if head_vocab_size == 1:
        return ("head_vocab_size=1: vLLM projects onto all V tokens, and the one token of the head vocabulary ties "
                "with every other (their rows can only copy its row), so vLLM would draft the lowest token id")
    return None


def vllm_projections(weight: torch.Tensor, token_map: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Projections vLLM's Medusa reads (``lm_heads.{h}.weight``, all V rows) for heads projecting onto V' tokens.

    Args:
        weight: ``[P, V', H]``, P projections (K heads, or 1 shared lm_head).
        token_map: ``[V']`` base token ids of the head vocabulary, or None (V' = V: returned unchanged).
        vocab_size: V.

    Returns:
        ``[P, V, H]`` in ``weight``'s dtype: row ``token_map[i]`` is ``weight[:, i]``, every other row the mean of the
        V' rows (accumulated in fp32), so no other token's logit exceeds the head's best one.
    """
    if token_map is None:
        return weight
    P, _, H = weight.shape
    mean = weight.float().mean(dim=1, keepdim=True).to(weight.dtype)  # [P, 1, H]
    full = mean.expand(P, vocab_size, H).clone()  # [P, V, H]
    full[:, token_map.to(weight.device)] = weight
    return full


def _write_vllm(
    heads: DraftHeads, folder: Path, token_map: torch.Tensor | None, base_lm_head: torch.Tensor | None
) -> None:
    """``vllm/``; ``base_lm_head [V, H]`` (given exactly when ``share_lm_head``) becomes ``lm_heads.0.weight``."""
    spec = heads.spec
    if base_lm_head is not None:
        weight = base_lm_head.detach()  # [V, H]
        if heads.token_map is not None:
            weight = weight[heads.token_map.to(weight.device)]  # [V', H]
        projections = weight.to(heads.block_weight.dtype).unsqueeze(0)  # [1, V', H] -> lm_heads.0.weight
    else:
        projections = heads.lm_head_weight.detach()  # [K, V', H]
    projections = vllm_projections(projections, token_map, spec.vocab_size)  # [P, V, H]
    tensors = split_heads(heads, VLLM, projections)
    if token_map is not None:
        tensors[VLLM_TOKEN_MAP] = token_map.clone()
    folder.mkdir(exist_ok=True)
    write_safetensors(folder / VLLM_WEIGHTS_FILE, tensors)
    write_json(folder / CONFIG_FILE, vllm_config(spec, heads.block_weight.dtype))
