"""An EAGLE-3 drafter in the ``speculators`` format (vllm-project/speculators), what vLLM serves with
``speculative_config={"method": "eagle3", "model": <export>/speculators, "num_speculative_tokens": K}``.

Layout (read in vLLM 0.32.0: ``vllm/transformers_utils/configs/speculators/{base,algos}.py`` and
``vllm/model_executor/models/llama_eagle3.py``)::

    speculators/
      config.json        speculators_model_type "eagle3", architectures ["Eagle3Speculator"], speculators_config
                         {algorithm, proposal_methods [{proposal_type "greedy", speculative_tokens K, ...}],
                         default_proposal_method, verifier {name_or_path, architectures}},
                         transformer_layer_config (the one-layer Llama config), draft_vocab_size, target_hidden_size,
                         eagle_aux_hidden_state_layer_ids, norm_before_residual / norm_before_fc / fc_norm /
                         norm_output (all false, written: vLLM takes a missing norm_before_residual as true,
                         speculators as false); no top-level model_type
      model.safetensors  fc.weight [H, 3H], midlayer.* (the decoder layer, q/k/v reading 2H), norm.weight,
                         lm_head.weight [V', H]; with V' < V also d2t [V'] int64 (target id = draft id + d2t) and
                         t2d [V] bool (the target ids in the draft vocabulary; vLLM skips it)

vLLM's target records the input of each tap layer (``EagleModelMixin._maybe_add_hidden_state``; the same index as
:mod:`medusa_train.models.features`) and concatenates the taps in ascending layer order (``_set_aux_hidden_state_layers``
sorts them), so ``fc``'s column blocks are written in that order and the ids sorted. Tap ``L`` (the last layer's
output) differs: vLLM's is before the final norm, ours after it, so a drafter reading it is refused when the target
is known. No ``embed_tokens``: vLLM shares the target's, which our drafter reads frozen.

:func:`expected_tensors` is the one table of what vLLM's ``Eagle3LlamaForCausalLM.load_weights`` reads (name, shape,
dtype); :func:`speculators_writer` refuses, by name and before anything is written, a tensor that is missing, extra
(a renamed one: vLLM would fail or silently skip it) or of another shape or dtype. Served EAGLE-3 exports whose
weights were skipped accept almost nothing, the failure most reported against speculators, vLLM and SpecForge.

vLLM and llama.cpp read ``speculators/`` themselves (our decoder reads ``eagle3_drafter.safetensors``), so a folder
changed after the export would be served as it is. :func:`check_served_files` runs before either reads it (vLLM rows,
:func:`~medusa_train.drafters.eagle3.vllm.speculative_config`; the GGUF conversion,
:func:`~medusa_train.drafters.eagle3.gguf.speculators_files`): ``model.safetensors``'s header must hold the tensors
of the drafter the export's ``config.json`` describes (the same table, read without loading a weight), no other
weights file may lie beside it (vLLM loads every ``*.safetensors`` there), and each file's sha256 must be the one the
export recorded (``engine_files_sha256``), which catches an edit of the same size. Hashing costs one read of the
files (about 1.4 s per GB on this machine's sha256; a 70B target's drafter is a few GB).

Shapes: H hidden, V target vocabulary, V' draft vocabulary, d head_dim, I the MLP width.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from medusa_train.export.files import read_json, sha256_files, write_json, write_safetensors
from medusa_train.models.features import count_layers
from medusa_train.files.safetensors_stream import DTYPE_NAMES

log = logging.getLogger(__name__)

SPECULATORS_DIR = "speculators"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FILES = (f"{SPECULATORS_DIR}/{CONFIG_FILE}", f"{SPECULATORS_DIR}/{WEIGHTS_FILE}")  # what an export owns here
SPECULATORS_MODEL_TYPE = "eagle3"
# Every norm variant vLLM's Eagle3 reads, as our drafter computes (drafter.py); all written explicitly.
NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # the header's dtype names (safe_open's get_dtype)
# transformer_layer_config keys that describe no shape (transformers' defaults, vocabulary token ids).
_DROPPED_LAYER_KEYS = ("transformers_version", "bos_token_id", "eos_token_id", "pad_token_id")


def expected_tensors(spec: Any, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor vLLM's ``Eagle3LlamaForCausalLM`` loads from ``model.safetensors`` for ``spec`` (an
    :class:`~medusa_train.drafters.eagle3.drafter.Eagle3Spec`), weights in ``dtype``: name -> (shape, dtype)."""
    H, V, Vd = spec.hidden_size, spec.vocab_size, spec.out_size
    q, kv, inner = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim, \
        spec.intermediate_size
    shapes = {
        "fc.weight": (H, len(spec.feature_layers) * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (inner, H),
        "midlayer.mlp.up_proj.weight": (inner, H),
        "midlayer.mlp.down_proj.weight": (H, inner),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    table = {name: (shape, dtype) for name, shape in shapes.items()}
    if Vd != V:  # vLLM then reads d2t into draft_id_to_target_id; without it every draft id maps to itself
        table["d2t"] = ((Vd,), torch.int64)
        table["t2d"] = ((V,), torch.bool)
    return table


def tensor_problems(found: dict[str, tuple[tuple[int, ...], torch.dtype]], spec: Any, dtype: torch.dtype
                    ) -> list[str]:
    """How ``found`` (name -> (shape, dtype)) differs from :func:`expected_tensors` of ``spec`` in ``dtype``: every
    missing tensor (``d2t`` with a reduced draft vocabulary among them), every extra one (a renamed tensor: vLLM
    would not load it under our name) and every shape or dtype that differs (expected and found); empty: none."""
    expected = expected_tensors(spec, dtype)
    problems = [f"{name} is missing (vLLM reads {list(shape)} {str(want).removeprefix('torch.')})"
                for name, (shape, want) in expected.items() if name not in found]
    problems += [f"{name} {list(found[name][0])} is not a tensor vLLM's Eagle3LlamaForCausalLM reads"
                 for name in found if name not in expected]
    for name, (shape, want) in expected.items():
        if name in found and found[name] != (shape, want):
            got_shape, got_dtype = found[name]
            problems.append(f"{name} is {list(got_shape)} {str(got_dtype).removeprefix('torch.')}, vLLM reads "
                            f"{list(shape)} {str(want).removeprefix('torch.')}")
    return problems


def check_tensors(tensors: dict[str, torch.Tensor], spec: Any, dtype: torch.dtype, source: str) -> None:
    """Compare ``tensors`` with :func:`expected_tensors` (:func:`tensor_problems`).

    Raises:
        ValueError: naming every problem, with ``source``.
    """
    problems = tensor_problems({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, spec, dtype)
    if problems:
        raise ValueError(f"{source}: the drafter's tensors do not match what vLLM loads: {'; '.join(problems)}. "
                         "Export a drafter built by medusa_train.drafters.eagle3.drafter.Eagle3Drafter from its own "
                         "spec")


def check_served_files(export_dir: str | os.PathLike[str]) -> Path:
    """Check that the export's ``speculators/`` is what the export wrote for its drafter, before an engine reads it
    (see the module docstring); returns the folder.

    Raises:
        FileNotFoundError: ``speculators/model.safetensors`` missing (re-export with ``export_vllm=true``).
        ValueError: the export's ``config.json`` is not an EAGLE-3 drafter's, or (each naming the file and the fix,
            a re-export): ``model.safetensors`` is not a safetensors file, or holds tensors missing, extra or of
            another shape or dtype than the drafter's (:func:`tensor_problems`, all named); another
            ``*.safetensors`` file lies in the folder; a file's sha256 differs from the one recorded at export.
            An export written before the sha256 was recorded gets a warning, and its tensors are still checked.
    """
    from medusa_train.models.catalog import drafter_type
    from medusa_train.export.configs import ENGINE_SHA256_KEY, export_head_type, spec_from_config

    export = Path(export_dir)
    folder, weights = export / SPECULATORS_DIR, export / SPECULATORS_DIR / WEIGHTS_FILE
    fix = f"re-export the drafter (export_vllm=true) to write {SPECULATORS_DIR}/ again"
    raw = read_json(export / CONFIG_FILE)
    entry = drafter_type(export_head_type(raw), str(export / CONFIG_FILE))
    if entry.name != SPECULATORS_MODEL_TYPE:
        raise ValueError(f"{export / CONFIG_FILE}: head_type {entry.name!r} ({entry.title} heads): {folder} holds an "
                         "EAGLE-3 drafter only in an EAGLE-3 export")
    spec = spec_from_config(entry, raw, str(export))
    dtype = getattr(torch, str(raw.get("torch_dtype", "float32")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{export / CONFIG_FILE}: torch_dtype {raw.get('torch_dtype')!r} is not a torch dtype")
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found: {fix}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            found = {name: (tuple(f.get_slice(name).get_shape()), _DTYPES.get(f.get_slice(name).get_dtype()))
                     for name in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"{weights} is not a safetensors file vLLM can read ({e}): {fix}") from e
    problems = tensor_problems(found, spec, dtype)
    if problems:
        raise ValueError(f"{weights} does not hold this export's EAGLE-3 drafter ({export / CONFIG_FILE}): "
                         f"{'; '.join(problems)}; vLLM and llama.cpp read this file as it is: {fix}")
    others = sorted(p.name for p in folder.glob("*.safetensors") if p.name != WEIGHTS_FILE)
    if others:
        raise ValueError(f"{folder} holds {', '.join(others)} beside {WEIGHTS_FILE}: vLLM loads every *.safetensors "
                         f"file there as the drafter's weights; remove them, or {fix}")
    recorded = raw.get(ENGINE_SHA256_KEY)
    if not isinstance(recorded, dict):
        log.warning("%s records no sha256 of %s/ (%s; exported before it was recorded): its tensors' names and shapes "
                    "are checked, not its bytes; %s to record them", export / CONFIG_FILE, SPECULATORS_DIR,
                    ENGINE_SHA256_KEY, fix)
        return folder
    for name in FILES:
        if name in recorded and sha256_files([export / name]) != recorded[name]:
            raise ValueError(f"{export / name} is not the file this export wrote: its sha256 differs from the one "
                             f"{export / CONFIG_FILE} recorded ({ENGINE_SHA256_KEY}), so it was changed since (edited "
                             f"or damaged); vLLM and llama.cpp would read it as it is: {fix}")
    return folder


def speculators_tensors(drafter: Any) -> dict[str, torch.Tensor]:
    """``model.safetensors``'s tensors of ``drafter`` (its state dict on the CPU, contiguous; ``fc``'s column
    blocks in ascending tap order; ``token_map`` as ``d2t`` offsets and the ``t2d`` mask). Not checked here."""
    spec = drafter.spec
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in drafter.state_dict().items()}
    token_map = state.pop("token_map", None)
    order = sorted(range(len(spec.feature_layers)), key=lambda j: spec.feature_layers[j])
    fc = state.get("fc.weight")
    if fc is not None and order != sorted(order) and fc.dim() == 2 and fc.shape[1] % len(order) == 0:
        state["fc.weight"] = torch.cat([fc.chunk(len(order), dim=1)[j] for j in order], dim=1).contiguous()
    if token_map is not None:
        state["d2t"] = token_map - torch.arange(token_map.numel(), dtype=torch.int64)
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[token_map] = True
        state["t2d"] = t2d
    return state


def speculators_config(spec: Any, verifier: str, verifier_architectures: list[str] | None,
                       num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """``speculators/config.json`` for ``spec`` (see the module docstring).

    Args:
        verifier: the target's Hub id or path (``speculators_config.verifier.name_or_path``).
        verifier_architectures: its ``architectures`` (e.g. ``["LlamaForCausalLM"]``), or None when unknown.
        num_speculative_tokens: the proposal's ``speculative_tokens`` (vLLM's default K when the serving command
            gives none); None: the drafter's training-time-test steps (``spec.num_heads``).
    """
    layer = {k: v for k, v in spec.layer_config().to_diff_dict().items() if k not in _DROPPED_LAYER_KEYS}
    layer["architectures"] = ["LlamaForCausalLM"]
    k = spec.num_heads if num_speculative_tokens is None else int(num_speculative_tokens)
    verifier_record: dict[str, Any] = {"name_or_path": verifier}
    if verifier_architectures:
        verifier_record["architectures"] = list(verifier_architectures)
    return {
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "architectures": ["Eagle3Speculator"],
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier_record,
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.out_size,
        "target_hidden_size": spec.hidden_size,
        "eagle_aux_hidden_state_layer_ids": sorted(spec.feature_layers),
        **NORM_FLAGS,
    }


def speculators_writer(heads: Any, *, base_model_name_or_path: str, base_model: Any = None
                       ) -> Callable[[Path], None]:
    """Check ``heads`` (an :class:`~medusa_train.drafters.eagle3.drafter.Eagle3Drafter`) for vLLM and return the
    function that writes ``speculators/`` into an export folder (:func:`medusa_train.export.save_export` calls it for
    the vllm engine of the eagle3 type, ``DrafterType.engine_writers``).

    Args:
        base_model_name_or_path: the verifier recorded in the config.
        base_model: the target ``*ForCausalLM`` (its class and layer count), or None.

    Raises:
        ValueError: a tensor missing, renamed, reshaped or of another dtype (:func:`check_tensors`, every one named);
            a tap at the target's last layer (``heads.feature_layers``; vLLM reads it before the final norm). Raised
            here, before anything is written.
    """
    spec = heads.spec
    tensors = speculators_tensors(heads)
    check_tensors(tensors, spec, heads.dtype, "refusing to write speculators/")
    if base_model is not None:
        num_layers = count_layers(base_model.config)
        if num_layers in spec.feature_layers:
            raise ValueError(f"heads.feature_layers={list(spec.feature_layers)} reads layer {num_layers}, the "
                             "target's last layer output, which vLLM taps before the final norm and this drafter "
                             f"read after it; train with taps below {num_layers} to serve it in vLLM, or export "
                             "with export_vllm=false")
    arch = None if base_model is None else [type(base_model).__name__]
    config = speculators_config(spec, base_model_name_or_path, arch)

    def write(folder: Path) -> None:
        out = folder / SPECULATORS_DIR
        out.mkdir(exist_ok=True)
        write_safetensors(out / WEIGHTS_FILE, tensors)
        write_json(out / CONFIG_FILE, config)

    return write


__all__ = ["CONFIG_FILE", "FILES", "NORM_FLAGS", "SPECULATORS_DIR", "SPECULATORS_MODEL_TYPE", "WEIGHTS_FILE",
           "check_served_files", "check_tensors", "expected_tensors", "speculators_config", "speculators_tensors",
           "speculators_writer", "tensor_problems"]
