"""Where the base model lives while the drafter trains (``base_placement``): replicated on every rank, or partitioned
over the ranks by DeepSpeed ZeRO-3.

``replicated`` loads the whole base on every rank's device (today's behaviour). ``zero3`` loads it partitioned as it
is read: transformers' ``from_pretrained`` builds the model inside ``deepspeed.zero.Init`` when an
``HfDeepSpeedConfig`` of stage 3 is alive (transformers ``integrations/deepspeed.py``, ``is_deepspeed_zero3_enabled``),
so rank r only ever holds its 1/world_size share of each parameter (``param.ds_tensor``). Forwards then gather each
layer's parameters just before it runs and free them after it (ZeRO-3's parameter hooks); every rank has to run the
same forwards in the same order (lockstep), else the gathers hang.

* Frozen base (Medusa-1, Hydra, EAGLE-3, :func:`load_zero3_base`): the hooks come from a ZeRO-3 engine with no
  optimizer, ``deepspeed.initialize(model=base, config=...)`` on :func:`zero3_inference_config` (DeepSpeed's
  documented "ZeRO-Inference": stage 3, no optimizer; the engine it builds is ``DeepSpeedZeRoOffload``). The base's
  lm_head and input embeddings, which the heads read on every step, are gathered once into ordinary replicated
  modules (:func:`replicate_output_and_input_embeddings`, ``deepspeed.zero.GatheredParameters``); after the hidden
  cache is built the backbone is dropped (:func:`release_backbone`) and the engine destroyed, so training holds only
  those (2 x V x H: 2.1 GB each for Llama-3.1-70B in bf16).
* Trained base (Medusa-2, :func:`zero3_for_trainer`): the Trainer's own ZeRO-3 engine owns the base (it trains its
  LoRA adapters or weights), so the base loads under the Trainer's DeepSpeed config and nothing is hidden from
  transformers.

Placement rule (:func:`resolve_base_placement`, the only place it is decided; logged): an explicit ``replicated`` or
``zero3`` is taken as given (checked by :func:`check_base_placement`); ``auto`` is ``zero3`` when the run has more than
one rank, the flow can run its base in lockstep (Medusa-1 with ``hidden_cache=true``; Medusa-2 under a ZeRO-3 trainer)
and either the trainer is DeepSpeed ZeRO-3 or the base's weights do not fit one device (:func:`base_fits_device`);
otherwise ``replicated``.

The GPU paths are planned, not run here: every test of this module runs on the CPU (gloo, 2 ranks).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from medusa_train.config.schema import FROZEN_BASE, JOINT, TrainConfig

log = logging.getLogger(__name__)

REPLICATED, ZERO3 = "replicated", "zero3"
# Share of a device's memory the replicated base may take under auto; the rest is the heads, their optimizer state,
# activations and the loss's logits chunk.
FIT_SHARE = 0.8


def is_zero3_config(ds_config: dict[str, Any] | None) -> bool:
    """Whether a DeepSpeed config (None: no DeepSpeed) is ZeRO stage 3."""
    return ds_config is not None and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


def lockstep_problem(cfg: TrainConfig, trainer_zero3: bool) -> str | None:
    """Why this run's flow cannot keep a ZeRO-3 base's forwards in lockstep on every rank (None: it can), with the
    fix named."""
    if cfg.data.self_distill and cfg.data.distill_engine == "hf":
        return ("data.self_distill_engine=hf generates with the training base, a different number of prompts on "
                "each rank, which a partitioned base cannot do: use data.self_distill_engine=vllm or server (they "
                "run before the base loads), or base_placement=replicated")
    if cfg.heads.mode == FROZEN_BASE and not cfg.hidden_cache:
        return ("a frozen base partitioned by ZeRO-3 runs its forwards once, into the hidden cache (the accuracy "
                "table runs on the main process only): set hidden_cache=true, or base_placement=replicated")
    if cfg.heads.mode == JOINT and not trainer_zero3:
        return (f"heads.mode={JOINT} trains the base, so its ZeRO-3 partitioning is the trainer's: use "
                "trainer=deepspeed_zero3, or base_placement=replicated")
    return None


def check_base_placement(cfg: TrainConfig, trainer_zero3: bool) -> None:
    """Refuse an explicit ``base_placement=zero3`` the run cannot honour (before anything loads).

    Raises:
        ValueError: naming ``base_placement`` and the field to change (see :func:`lockstep_problem`).
    """
    if cfg.base_placement == ZERO3:
        problem = lockstep_problem(cfg, trainer_zero3)
        if problem is not None:
            raise ValueError(f"base_placement=zero3: {problem}")


def resolve_base_placement(cfg: TrainConfig, *, world_size: int, trainer_zero3: bool, fits: bool) -> str:
    """``replicated`` or ``zero3`` for this run (the module docstring's rule), logged with its reason.

    Args:
        cfg: the run's config (``base_placement``, ``heads.mode``, ``hidden_cache``, ``data.*``).
        world_size: ranks in the job.
        trainer_zero3: the trainer's DeepSpeed config is stage 3.
        fits: the replicated base fits one device (:func:`base_fits_device`).
    """
    if cfg.base_placement != "auto":
        log.info("base placement: %s (base_placement=%s)", cfg.base_placement, cfg.base_placement)
        return cfg.base_placement
    problem = lockstep_problem(cfg, trainer_zero3)
    if world_size > 1 and problem is None and (trainer_zero3 or not fits):
        why = "the trainer is DeepSpeed ZeRO-3" if trainer_zero3 else "the base does not fit one device"
        log.info("base placement: zero3 (base_placement=auto: %d ranks and %s)", world_size, why)
        return ZERO3
    why = ("one rank" if world_size == 1 else f"ZeRO-3 cannot serve this run: {problem}" if problem
           else "the base fits one device and the trainer is not ZeRO-3")
    log.info("base placement: replicated (base_placement=auto: %s)", why)
    return REPLICATED


def base_fits_device(num_bytes: int, device: torch.device) -> bool:
    """Whether ``num_bytes`` of base weights take at most :data:`FIT_SHARE` of ``device``'s memory; always True on
    the CPU (host memory is not what ZeRO-3 partitions here)."""
    if device.type != "cuda":
        return True
    return num_bytes <= FIT_SHARE * torch.cuda.get_device_properties(device).total_memory


def zero3_inference_config(dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a frozen base's ZeRO-3 engine: stage 3 with no optimizer (ZeRO-Inference), every
    parameter partitioned (``stage3_param_persistence_threshold=0``: none kept whole on each rank), weights in
    ``dtype`` (bf16/fp16 sections enabled accordingly). ``train_micro_batch_size_per_gpu`` is required by DeepSpeed's
    config check and unused (the engine never steps)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 50_000_000},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


@contextlib.contextmanager
def hf_deepspeed_config(ds_config: dict[str, Any] | None, trainer_config: Any | None) -> Iterator[None]:
    """Within the block transformers sees ``ds_config`` (None: no DeepSpeed config at all) instead of the Trainer's
    ``trainer_config`` (``TrainingArguments.hf_deepspeed_config``, or None), which is restored on exit.

    With a stage-3 ``ds_config`` alive, ``from_pretrained`` loads the model partitioned (``deepspeed.zero.Init``);
    with None the model loads whole, outside any ZeRO-3 partitioning.
    """
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    held = HfDeepSpeedConfig(ds_config) if ds_config is not None else None  # transformers keeps a weak reference
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del held
        if trainer_config is not None:
            set_hf_deepspeed_config(trainer_config)


def start_deepspeed_comm() -> None:
    """``deepspeed.comm`` over the running ``torch.distributed`` group (its backend). A partitioned load
    (``deepspeed.zero.Init`` inside ``from_pretrained``) reads the world size from it, and takes 1 where it has not
    started: a Medusa-2 run under ZeRO-3 without stage 1 (whose ZeRO-3 engine starts it) loads before any engine."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def start_zero3_engine(base: nn.Module, ds_config: dict[str, Any]) -> Any:
    """A ZeRO-3 engine with no optimizer over a base loaded partitioned (``deepspeed.initialize``): it registers the
    hooks that gather each module's parameters for its forward. Returns the engine (keep it until the base's last
    forward, then :func:`stop_zero3_engine`)."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=base, config=ds_config)
    engine.eval()
    return engine


def stop_zero3_engine(engine: Any) -> None:
    """Destroy a ZeRO-3 engine from :func:`start_zero3_engine` (its hooks and buffers); the caller drops the base."""
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 partitioned parameter (it carries ``ds_id`` and ``ds_tensor``)."""
    return hasattr(param, "ds_id")


def gathered(tensor: torch.Tensor) -> Any:
    """``deepspeed.zero.GatheredParameters([tensor])`` (read only) for a ZeRO-3 partitioned parameter that is not
    gathered now, else a null context: within it ``tensor`` holds its full value. Collective for a partitioned one:
    every rank enters it. A parameter the running forward already holds whole (a tied lm_head inside its model's
    forward) is left to the hooks that gathered it: leaving the context would release it under them."""
    if not is_partitioned(tensor):
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if tensor.ds_status != ZeroParamStatus.NOT_AVAILABLE:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)


def partition_numel(model: nn.Module) -> tuple[int, int]:
    """``(held, total)``: the elements of ``model``'s parameters this rank holds (its ZeRO-3 partitions
    ``param.ds_tensor``, or whole parameters that are not partitioned) and their full count (``param.ds_numel``)."""
    held = total = 0
    for param in model.parameters():
        if is_partitioned(param):
            held += int(param.ds_tensor.numel())
            total += int(param.ds_numel)
        else:
            held += param.numel()
            total += param.numel()
    return held, total


def _replicated_leaf(module: nn.Module) -> nn.Module:
    """A copy of the leaf module ``module`` (an ``nn.Linear`` lm_head, an ``nn.Embedding`` or a subclass) whose
    parameters are whole, ordinary tensors (gathered under ZeRO-3) and that has no hooks; attributes (``padding_idx``,
    ``embed_scale``...) and buffers are shared with the original."""
    import deepspeed

    clone = module.__class__.__new__(module.__class__)
    clone.__dict__.update(module.__dict__)
    for name in list(clone.__dict__):
        if name.startswith("_") and name.endswith("hooks") or name.endswith("hooks_with_kwargs"):
            clone.__dict__[name] = OrderedDict()
    clone._forward_hooks_always_called = OrderedDict()
    clone._buffers = OrderedDict(module._buffers)
    params = OrderedDict()
    partitioned = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None, enabled=bool(partitioned)):
        for name, p in module._parameters.items():
            params[name] = None if p is None else nn.Parameter(p.data.detach().clone(), requires_grad=False)
    clone._parameters = params
    return clone


def replicate_output_and_input_embeddings(base: Any) -> None:
    """Replace ``base``'s lm_head and input embeddings by whole copies on every rank (ZeRO-3 gathers them once), so
    the heads (their initial weights, ``share_lm_head``, Hydra's path embeddings, the loss's base logits) read them
    without the engine; tied weights stay tied. Call after :func:`start_zero3_engine` (the engine would partition them
    again). The backbone's embedding module is swapped too, so its forward reads the same whole copy."""
    lm_head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    new_embed = _replicated_leaf(embed)
    tied = lm_head.weight is embed.weight
    new_head = _replicated_leaf(lm_head)
    if tied:
        new_head._parameters["weight"] = new_embed.weight
    base.set_input_embeddings(new_embed)
    base.set_output_embeddings(new_head)


def release_backbone(base: Any) -> None:
    """Drop every part of ``base``'s backbone but its input embeddings (decoder layers, final norm, rotary tables),
    keeping the model object (its class, config, lm_head and input embeddings, which the export and the heads read):
    after the hidden cache is built the frozen base's layers are no longer needed, and this frees them (garbage
    collected here). The base cannot run a forward afterwards."""
    backbone, embed = base.base_model, base.get_input_embeddings()
    for name, child in list(backbone.named_children()):
        if child is not embed:
            setattr(backbone, name, nn.Module())  # an empty stand-in: no parameters, nothing to gather
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
