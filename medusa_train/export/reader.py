"""Load draft heads from our export folder (Medusa or Hydra heads), a FasterDecoding folder, or a vLLM Medusa
folder, strictly.

Every key is accounted for (missing and unexpected keys are listed in one error), every shape is checked against
the config and every weight is checked finite before anything is copied into the heads (the type's module);
with a base model, the heads' hidden size and vocabulary are checked against it first. The head type comes from
config.json (``head_type``, absent for Medusa heads); a type this reader does not know, or one other than the caller
asked for, is refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from medusa_train.export.configs import (
    VLLM_HEAD_VOCAB_KEY,
    VLLM_MODEL_TYPE,
    VLLM_TOKEN_MAP,
    check_field_types,
    check_version,
    export_head_type,
    read_vllm_config,
    spec_from_config,
    spec_from_medusa_config,
)
from medusa_train.export.files import read_json, read_tensors, sha256_files
from medusa_train.export.layouts import (
    FASTERDECODING,
    VLLM,
    check_finite,
    check_keys_and_shapes,
    expected_shapes,
    stack_heads,
)
from medusa_train.export.writer import (
    CONFIG_FILE,
    LEGACY_WEIGHTS_FILE,
    TOKEN_MAP_FILE,
    WEIGHTS_FILE,
)
from medusa_train.export.tree_files import read_tree_files
from medusa_train.models.catalog import (
    MEDUSA_LAYOUT,
    DrafterType,
    check_head_type,
    drafter_type,
    expect_head_type,
    heads_from_spec,
)
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.models.speculative import DraftHeads, base_sizes, check_heads_match_base


def read_export_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of an export (or FasterDecoding / vLLM) folder, as written.

    Raises:
        FileNotFoundError: the folder or its config.json does not exist.
        ValueError: config.json is not a JSON object (chained to the parser's error).
    """
    folder = _folder(path)
    return read_json(folder / CONFIG_FILE)


def heads_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files :func:`load_heads` reads the heads' weights from: the weights file of the type ``config.json``
    names (``head_type``: a ``state_dict``-layout type's own, e.g. Hydra's; Medusa heads: safetensors before
    ``.pt``) and ``token_map.safetensors`` when present, or a vLLM folder's ``*.safetensors``.

    Raises:
        FileNotFoundError: the folder does not exist or holds no heads (the type's weights file named, as
            :func:`load_heads` names it).
        ValueError: ``config.json`` is malformed or names a head type this reader does not know.
    """
    folder = _folder(path)
    config_path = folder / CONFIG_FILE
    raw = read_json(config_path) if config_path.is_file() else {}
    entry = drafter_type(check_head_type(export_head_type(raw), str(config_path)))
    weights = _state_dict_weights(entry, folder) if entry.layout != MEDUSA_LAYOUT else _weights_file(folder)
    if weights is not None:
        token_map = folder / TOKEN_MAP_FILE
        return [weights, token_map] if token_map.is_file() else [weights]
    files = sorted(folder.glob("*.safetensors"))
    if not files or raw.get("model_type") != VLLM_MODEL_TYPE:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE} in {folder}: is this an export folder?")
    return files


def _state_dict_weights(entry: DrafterType, folder: Path) -> Path:
    """The weights file of a ``state_dict``-layout export of type ``entry``.

    Raises:
        FileNotFoundError: it is missing (named, with the type config.json records).
    """
    weights = folder / entry.weights_file
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found: {folder}/config.json says head_type {entry.name!r}")
    return weights


def heads_checksum(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of the heads' weight files (:func:`heads_files`): what identifies the heads a measurement used.

    Raises:
        FileNotFoundError: as :func:`heads_files`.
    """
    return sha256_files(heads_files(path))


def check_fasterdecoding_copy(path: str | os.PathLike[str]) -> bool:
    """Check that ``medusa_lm_head.pt`` beside ``medusa_lm_head.safetensors`` holds the same heads (FasterDecoding's
    loader reads the ``.pt``, every other loader the safetensors): the same keys and values, plus with
    ``share_lm_head`` a finite ``[V, H]`` projection per head. Returns False when the folder has no such pair.

    Raises:
        ValueError: the ``.pt`` is damaged, holds other keys or shapes, non-finite values, or other weights than
            the safetensors file (re-export to rewrite both).
    """
    folder = _folder(path)
    pt, safetensors = folder / LEGACY_WEIGHTS_FILE, folder / WEIGHTS_FILE
    if not (pt.is_file() and safetensors.is_file()):
        return False
    raw = read_json(folder / CONFIG_FILE)
    ours = read_tensors(safetensors)
    theirs = read_tensors(pt)
    spec = spec_from_medusa_config(raw, {k: tuple(v.shape) for k, v in ours.items()}, None, str(folder))
    check_keys_and_shapes(theirs, expected_shapes(FASTERDECODING, spec, projections=spec.num_heads), str(pt),
                          "re-export to write medusa_lm_head.pt again")
    check_finite(theirs, str(pt))
    differ = [k for k, v in ours.items() if not torch.equal(theirs[k], v)]
    if differ:
        raise ValueError(f"{pt} holds other weights than {safetensors.name} (e.g. {differ[:3]}): it is left from "
                         "another export; re-export to write both again")
    return True


def _weights_file(folder: Path) -> Path | None:
    # Our safetensors file wins over a .pt beside it (FasterDecoding's loader would read the .pt).
    return next((folder / n for n in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE) if (folder / n).is_file()), None)


def load_heads(
    path: str | os.PathLike[str],
    base_model: PreTrainedModel | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    head_type: str | None = None,
) -> tuple[DraftHeads, dict[str, Any]]:
    """Load heads from a folder written by :func:`save_export`, by FasterDecoding, or the ``vllm/`` folder.

    Formats, by the files present:

    - ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` (``torch.load(weights_only=True)``) + ``config.json``
      (``medusa_num_heads``; ``medusa_num_layers``, ``hidden_size`` and ``vocab_size`` inferred when absent), plus
      ``token_map.safetensors`` when config.json has ``head_vocab_size``. Without ``{h}.{L}.weight`` projections
      config.json must say ``share_lm_head: true``.
    - a vLLM Medusa folder: ``config.json`` with ``model_type: "medusa"`` and ``*.safetensors`` read by vLLM's
      rules (``medusa_heads.`` prefix dropped, biases only with ``medusa_fc_bias``, ``token_map`` with
      ``truncated_vocab_size < vocab_size``, projections of V rows cut to the token map); ours records a reduced
      head vocabulary as ``medusa_train_head_vocab_size`` + ``medusa_train.token_map`` beside V-row projections. ``original_lm_head``
      loads as ``share_lm_head=True``; its stored lm_head is checked against ``base_model``'s when one is given.
    - other drafter types (``state_dict`` layout, :mod:`medusa_train.models.catalog`): ``config.json`` with their
      ``head_type`` and the type's weights file (Hydra: ``hydra_heads.safetensors``) (+ the token map).

    Args:
        path: the folder.
        base_model: the base ``*ForCausalLM``; when given, its sizes are checked against the heads' before loading.
        dtype: dtype of the returned heads; default: that of the stored residual-block weights.
        device: device of the returned heads; default CPU.
        head_type: a registered type (``medusa``, ``hydra``, ...) to refuse heads of another type (None: any).

    Returns:
        ``(heads, config)``: heads with ``block_weight [K, L, H, H]``, ``block_bias [K, L, H]``, ``lm_head_weight
        [K, V', H]`` (absent when shared), ``token_map [V']`` long (reduced vocabulary only); config is the folder's
        config.json with the normalised fields ``medusa_num_heads``, ``medusa_num_layers``, ``hidden_size``,
        ``vocab_size``, ``share_lm_head``, ``head_vocab_size`` (None for the full vocabulary), and ``source_format``
        (``medusa-train``, ``fasterdecoding`` or ``vllm``). Other types' heads (Hydra:
        :class:`~medusa_train.drafters.hydra.heads.HydraHeads`): config.json as written with ``head_vocab_size``
        normalised and ``source_format`` ``medusa-train``.

    Raises:
        FileNotFoundError: the folder, its weights, config.json or token_map.safetensors is missing (named).
        ValueError: damaged file (path named, chained), missing/unexpected keys (listed), wrong shapes, bad token map,
            NaN or Inf weights (tensor and head named), heads for another base model (``hidden_size`` /
            ``vocab_size`` named), a ``head_type`` this reader does not know, or heads of another type than
            ``head_type`` (both named), a config.json field of the wrong type, or a tuned file
            (``medusa_choices.json``, ``head_accuracy.json``, ``latency_profile.json``) that is not UTF-8 JSON of its
            shape or does not fit the heads (:func:`~medusa_train.export.tree_files.read_tree_files`; file and field
            named): every file the export holds is checked here, before any base model loads.
    """
    folder = _folder(path)
    base_hv = None if base_model is None else base_sizes(base_model)
    config_path = folder / CONFIG_FILE
    if head_type is not None:
        check_head_type(head_type, "load_heads(head_type=...)")
    raw = read_json(config_path) if config_path.is_file() else {}
    found = check_head_type(export_head_type(raw), str(config_path))
    expect_head_type(found, head_type, str(folder))
    entry = drafter_type(found)
    if entry.layout != MEDUSA_LAYOUT:
        check_version(raw, str(folder))
        check_field_types(raw, str(folder))
        heads, config = _read_state_dict(entry, folder, raw, base_model, dtype, device)
        read_tree_files(folder, heads.spec.num_heads, heads.spec.out_size)
        return heads, config
    weights = _weights_file(folder)
    if weights is not None:
        raw = read_json(config_path)
        check_version(raw, str(folder))
        check_field_types(raw, str(folder))
        spec, stacked, token_map, fmt = _read_medusa(folder, weights, raw, base_model, base_hv)
    else:
        if raw.get("model_type") != VLLM_MODEL_TYPE:
            raise FileNotFoundError(
                f"no {WEIGHTS_FILE} or {LEGACY_WEIGHTS_FILE} in {folder}: is this an export folder?")
        spec, stacked, token_map = _read_vllm(folder, raw, base_model)
        fmt = "vllm"
    read_tree_files(folder, spec.num_heads, spec.out_size)  # the tuned files, checked now rather than after decoding

    with torch.device("meta"):
        heads = heads_from_spec(spec, None if token_map is None else torch.empty_like(token_map, device="meta"))
    if token_map is not None:
        stacked["token_map"] = token_map
    heads.load_state_dict(stacked, strict=True, assign=True)
    heads = heads.to(device=device or "cpu", dtype=dtype or stacked["block_weight"].dtype)
    config = {
        **raw,
        "medusa_num_heads": spec.num_heads,
        "medusa_num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "share_lm_head": spec.share_lm_head,
        "head_vocab_size": spec.head_vocab_size,
        "source_format": fmt,
    }
    return heads, config


def _read_state_dict(
    entry: DrafterType, folder: Path, raw: dict[str, Any], base_model: PreTrainedModel | None,
    dtype: torch.dtype | None, device: torch.device | str | None,
) -> tuple[DraftHeads, dict[str, Any]]:
    """A ``state_dict``-layout export of type ``entry`` -> (heads, config), every key and shape checked against the
    config before copying."""
    spec = spec_from_config(entry, raw, str(folder))
    if base_model is not None:
        check_heads_match_base(spec, base_model)
    weights = _state_dict_weights(entry, folder)
    state = read_tensors(weights)
    token_map = _read_token_map(folder, spec)
    with torch.device("meta"):
        heads = heads_from_spec(spec, None if token_map is None else torch.empty_like(token_map, device="meta"))
    expected = {k: tuple(v.shape) for k, v in heads.state_dict().items() if k != "token_map"}
    check_keys_and_shapes(state, expected, str(weights))
    check_finite(state, str(weights))
    stored_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    if token_map is not None:
        state["token_map"] = token_map
    heads.load_state_dict(state, strict=True, assign=True)
    heads = heads.to(device=device or "cpu", dtype=dtype or stored_dtype)
    return heads, {**raw, "head_vocab_size": spec.head_vocab_size, "source_format": "medusa-train"}


def _read_token_map(folder: Path, spec: HeadsSpec) -> torch.Tensor | None:
    """The checked ``[V']`` token map of ``token_map.safetensors`` when ``spec`` has a reduced vocabulary, else None.

    Raises:
        FileNotFoundError: the file is missing. ValueError: it holds other tensors or a bad map (named).
    """
    if spec.head_vocab_size is None:
        return None
    tm_path = folder / TOKEN_MAP_FILE
    if not tm_path.is_file():
        raise FileNotFoundError(f"{tm_path} not found: config.json has head_vocab_size={spec.head_vocab_size}, "
                                "which needs the token map")
    tm_state = read_tensors(tm_path)
    if set(tm_state) != {"token_map"}:
        raise ValueError(f"{tm_path} must hold exactly one tensor 'token_map', got keys {sorted(tm_state)}")
    return _checked_token_map(tm_state["token_map"], spec, str(tm_path))


def _folder(path: str | os.PathLike[str]) -> Path:
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"export folder {folder} does not exist")
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is a file; pass the export folder that holds it")
    return folder


def _read_medusa(
    folder: Path, weights: Path, raw: dict[str, Any], base_model: PreTrainedModel | None,
    base_hv: tuple[int, int] | None,
) -> tuple[HeadsSpec, dict[str, torch.Tensor], torch.Tensor | None, str]:
    """Our export or a FasterDecoding folder -> (spec, stacked state, token map, format name)."""
    state = read_tensors(weights)
    spec = spec_from_medusa_config(raw, {k: tuple(v.shape) for k, v in state.items()}, base_hv, str(folder))
    if base_model is not None:
        check_heads_match_base(spec, base_model)
    token_map = _read_token_map(folder, spec)
    expected = expected_shapes(FASTERDECODING, spec, projections=0 if spec.share_lm_head else spec.num_heads)
    hint = ("if these heads project with the base model's lm_head, set share_lm_head: true in config.json"
            if not spec.share_lm_head else "")
    check_keys_and_shapes(state, expected, str(weights), hint)
    check_finite(state, str(weights))
    fmt = "medusa-train" if "medusa_train_version" in raw else "fasterdecoding"
    return spec, stack_heads(state, FASTERDECODING, spec), token_map, fmt


def _read_vllm(
    folder: Path, raw: dict[str, Any], base_model: PreTrainedModel | None
) -> tuple[HeadsSpec, dict[str, torch.Tensor], torch.Tensor | None]:
    """A vLLM Medusa folder -> (spec, stacked state, token map), following ``Medusa.load_weights`` in vLLM."""
    spec, fc_bias = read_vllm_config(raw, str(folder))
    if base_model is not None:
        check_heads_match_base(spec, base_model)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (vLLM Medusa folder: config.json says "
                                "model_type 'medusa')")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in read_tensors(file).items():
            name = name.replace("medusa_heads.", "")  # vLLM drops this prefix
            if name in state:
                raise ValueError(f"{folder}: key {name!r} appears in more than one weights file")
            state[name] = tensor
    source = f"{folder} ({', '.join(f.name for f in files)})"
    token_map = None
    if spec.head_vocab_size is not None:
        name = VLLM_TOKEN_MAP if raw.get(VLLM_HEAD_VOCAB_KEY) is not None else "token_map"
        if name not in state:
            raise ValueError(f"{source}: a head vocabulary of {spec.head_vocab_size} < vocab_size="
                             f"{spec.vocab_size} tokens needs a {name!r} tensor, which is missing")
        token_map = _checked_token_map(state.pop(name), spec, source)
    if spec.share_lm_head and "lm_head.weight" in state and "lm_heads.0.weight" not in state:
        state["lm_heads.0.weight"] = state.pop("lm_head.weight")  # vLLM's own parameter name, also accepted
    projections = 1 if spec.share_lm_head else spec.num_heads
    for h in range(projections):
        name = VLLM.projection.format(h=h)
        if token_map is not None and name in state and state[name].shape[0] == spec.vocab_size:
            state[name] = state[name][token_map]  # vLLM cuts full-vocabulary projections to the token map
    check_keys_and_shapes(state, expected_shapes(VLLM, spec, projections, with_bias=fc_bias), source)
    check_finite(state, source)
    if spec.share_lm_head and base_model is not None:
        stored = state["lm_heads.0.weight"].float()
        base = base_model.get_output_embeddings().weight.detach().float().cpu()
        base = base if token_map is None else base[token_map]
        if not torch.allclose(stored, base, rtol=1e-2, atol=1e-3):
            raise ValueError(f"{source}: original_lm_head=true but lm_heads.0.weight differs from the base model's "
                             "lm_head; these heads were exported for another base model")
    return spec, stack_heads(state, VLLM, spec, with_bias=fc_bias), token_map


def _checked_token_map(token_map: torch.Tensor, spec: HeadsSpec, source: str) -> torch.Tensor:
    """``[V']`` int64 of distinct base token ids in ``[0, V)``, or ``ValueError`` naming ``source``."""
    if token_map.shape != (spec.head_vocab_size,) or token_map.is_floating_point() or token_map.is_complex():
        raise ValueError(f"{source}: token_map must be an integer tensor of shape [{spec.head_vocab_size}], "
                         f"got {token_map.dtype} {tuple(token_map.shape)}")
    token_map = token_map.to(torch.long)
    if token_map.numel() and (int(token_map.min()) < 0 or int(token_map.max()) >= spec.vocab_size):
        raise ValueError(f"{source}: token_map ids must lie in [0, vocab_size={spec.vocab_size})")
    if torch.unique(token_map).numel() != token_map.numel():
        raise ValueError(f"{source}: token_map holds repeated token ids")
    return token_map
