"""The bytes each stage of a run needs on one GPU and one host, term by term (:class:`~.terms.Term`).

Stages (each a function of the target's and the drafter's sizes, :mod:`.meta`, and :class:`~.settings.PlanSettings`):

- :func:`self_distill_stage`: vLLM engines regenerating the replies: the base's weights split over
  ``tensor_parallel_size`` GPUs, the KV cache of ``max_num_seqs`` sequences of ``seq`` tokens and an activation
  margin; the smallest tensor-parallel size that fits is chosen, the node runs ``gpus_per_host / tp`` engines.
- :func:`cache_build_stage`: the frozen base's forward pass writing the hidden-state cache.
- :func:`training_stage`: heads trained on the cache (or on the base's forward pass), or Medusa-2's joint training.
- :func:`export_stage`: the heads' state dict gathered on the host and written as safetensors.

The constants below are margins a GPU run would measure; they are planned, not measured (no GPU ran this plan).
Sources for the per-parameter bytes: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", Sec. 3.1 (mixed-precision Adam: 2 + 2 + 12 bytes per parameter; ZeRO stages 1-3 partition the 12,
then the gradients' 2, then the parameters' 2 over the ranks), Sec. 5.
"""

from __future__ import annotations

import math

from medusa_train.config.schema import JOINT
from medusa_train.planning.meta import HeadsSizes, TargetSizes
from medusa_train.planning.settings import PlanSettings, dtype_bytes
from medusa_train.planning.terms import GIB, Stage, Term, term

# Per GPU: the CUDA context, NCCL's buffers and the caching allocator's fragmentation (planned, not measured).
CUDA_RESERVE_BYTES = 2 * GIB
# Per rank of a CPU run: a process with torch and transformers imported holds 0.37 GiB RSS (measured on the 2-core
# Xeon test machine); 1 GiB planned for the Trainer, the DataLoader and the allocator.
CPU_RESERVE_BYTES = 1 * GIB
# Per vLLM engine GPU: the activation peak vLLM profiles at start and its CUDA graphs (planned, not measured).
VLLM_ACTIVATION_MARGIN_BYTES = 4 * GIB
# The highest gpu_memory_utilization the plan gives vLLM (its default is 0.9; above 0.95 it fails on most drivers).
VLLM_MAX_UTILIZATION = 0.95
# Per rank on the host: the Python process, torch, CUDA's pinned buffers (planned, not measured).
HOST_PROCESS_BYTES = 4 * GIB
# Adam's two fp32 moments (m, v) per trainable parameter.
ADAM_BYTES = 8
# The per-token entries a cache row stores besides the features: base_argmax, labels, input_ids (int64 each).
TOKEN_KEY_BYTES = 3 * 8
# conf/deepspeed/*.json reduce_bucket_size: elements of DeepSpeed's gradient bucket (two buckets in flight).
DS_BUCKET_ELEMENTS = 50_000_000


def reserve(s: PlanSettings) -> Term:
    """What a rank's device holds besides its tensors: :data:`CUDA_RESERVE_BYTES` on a GPU,
    :data:`CPU_RESERVE_BYTES` on a CPU run."""
    if s.device_kind == "cpu":
        return Term("process reserve", CPU_RESERVE_BYTES, "CPU_RESERVE_BYTES")
    return Term("CUDA reserve", CUDA_RESERVE_BYTES, "CUDA_RESERVE_BYTES (planned)")


def _tp_candidates(target: TargetSizes, gpus_per_host: int) -> list[int]:
    """Tensor-parallel sizes vLLM accepts here: powers of two dividing the attention heads, at most a host's GPUs."""
    out, tp = [], 1
    while tp <= gpus_per_host:
        if target.num_attention_heads % tp == 0:
            out.append(tp)
        tp *= 2
    return out


def self_distill_stage(target: TargetSizes, s: PlanSettings) -> Stage:
    """vLLM engines generating the self-distilled replies (``data.self_distill_engine=vllm``).

    Per GPU of an engine with tensor-parallel size tp: ``params x dtype / tp`` (weights), ``2 (K, V) x layers x
    ceil(num_kv_heads / tp) x head_dim x dtype x max_num_seqs x seq`` (the KV cache, each KV head on one GPU),
    :data:`VLLM_ACTIVATION_MARGIN_BYTES` and :func:`reserve`. The smallest tp whose sum is at most
    :data:`VLLM_MAX_UTILIZATION` of a GPU is chosen (the largest when none fits, so the stage reports the
    shortfall); ``gpu_memory_utilization`` is that sum over the GPU's bytes, rounded up to 0.01.
    """
    b = dtype_bytes(s.base_dtype)
    chosen = None
    for tp in _tp_candidates(target, s.per_host):
        kv_heads = math.ceil(target.num_kv_heads / tp)
        gpu = (
            term("weights (base / tp)", target.params, b, "params", divide=tp),
            term("KV cache", 2 * target.num_layers * kv_heads * target.head_dim * s.max_num_seqs * s.seq, b,
                 f"values (2 x {target.num_layers} layers x {kv_heads} KV heads x {target.head_dim} x "
                 f"{s.max_num_seqs} seqs x {s.seq} tokens)"),
            Term("activation margin", VLLM_ACTIVATION_MARGIN_BYTES, "VLLM_ACTIVATION_MARGIN_BYTES (planned)"),
            reserve(s),
        )
        chosen = (tp, gpu)
        if sum(t.bytes for t in gpu) <= VLLM_MAX_UTILIZATION * s.gpu_bytes:
            break
    tp, gpu = chosen
    need = sum(t.bytes for t in gpu)
    engines = s.per_host // tp
    utilization = min(math.ceil(100 * need / s.gpu_bytes) / 100, 1.0)
    headroom = int((1 - VLLM_MAX_UTILIZATION) * s.gpu_bytes)
    gpu += (Term("left outside vLLM", headroom, f"(1 - VLLM_MAX_UTILIZATION {VLLM_MAX_UTILIZATION}) x GPU bytes"),)
    host = (term("engine processes", s.per_host, HOST_PROCESS_BYTES, "GPU workers"),)
    notes = (f"the weights are read through the page cache (reclaimable, {target.params * b / GIB:.1f} GiB per host, "
             "not counted)",)
    if need + headroom > s.gpu_bytes:
        notes += (f"no tensor_parallel_size up to {s.per_host} fits: lower data.generation_batch_size "
                  "(max_num_seqs) or max_length, or use GPUs with more memory",)
    return Stage("self_distill", gpu=gpu, host=host, notes=notes,
                 choices={"tensor_parallel_size": tp, "engines_per_host": engines,
                          "gpu_memory_utilization": utilization})


def base_weights(target: TargetSizes, s: PlanSettings, placement: str) -> tuple[Term, ...]:
    """A frozen base on one GPU: whole (``replicated``) or ZeRO-3's shard plus the largest block it gathers."""
    b = dtype_bytes(s.base_dtype)
    if placement == "replicated":
        return (term("base weights (replicated)", target.params, b, "params"),)
    return (term("base shard (ZeRO-3)", target.params, b, "params", divide=s.gpus),
            term("largest gathered block", target.largest_gathered, b, "params"))


def base_forward(target: TargetSizes, s: PlanSettings, features: int) -> tuple[Term, ...]:
    """A no-grad forward pass of one batch: one layer's working set at a time (``B x T x (4H + 3I)``: the residual
    stream in and out, attention's query and output, the MLP's gate, up and their product; attention itself is
    SDPA's, no ``T x T`` matrix) and the features kept for the drafter (``features x B x T x H``)."""
    b = dtype_bytes(s.base_dtype)
    tokens = s.batch * s.seq
    return (term("base forward (one layer)", tokens * (4 * target.hidden_size + 3 * target.intermediate_size), b,
                 f"token-widths ({tokens} tokens x (4H + 3I))"),
            term("target features kept", features * tokens * target.hidden_size, b,
                 f"values ({features} features x {tokens} tokens x H)"))


def choose_placement(target: TargetSizes, s: PlanSettings, rest: int) -> str:
    """``base_placement`` resolved: ``replicated`` when set, or with ``auto`` when the whole base plus ``rest``
    bytes fit one GPU; else ``zero3``."""
    if s.base_placement != "auto" or s.gpus == 1:
        return "replicated" if s.base_placement == "auto" else s.base_placement
    whole = target.params * dtype_bytes(s.base_dtype)
    return "replicated" if whole + rest <= s.gpu_bytes else "zero3"


def cache_build_stage(target: TargetSizes, heads: HeadsSizes, s: PlanSettings) -> Stage:
    """The frozen base writing the hidden-state cache: base weights (:func:`base_weights`, placement by
    :func:`choose_placement`), one batch's forward (:func:`base_forward`), the base logits the greedy targets are
    taken from (``hidden_cache.py`` projects ``trainer.loss_chunk_size`` positions at a time: ``min(chunk, B x T) x V
    x dtype``; the whole batch's with 0) and :func:`reserve`. Disk: per token ``features x H x dtype`` (EAGLE-3
    stores its three taps and the final state) plus :data:`TOKEN_KEY_BYTES`, times ``tokens``."""
    b = dtype_bytes(s.base_dtype)
    n_feat = len(heads.features)
    forward = base_forward(target, s, n_feat)
    rows = min(s.loss_chunk_size or s.batch * s.seq, s.batch * s.seq)
    logits = term("base logits (argmax targets)", rows * target.vocab_size, b, f"logits ({rows} tokens x V)")
    rest = sum(t.bytes for t in forward) + logits.bytes + reserve(s).bytes
    placement = choose_placement(target, s, rest)
    gpu = (*base_weights(target, s, placement), *forward, logits,
           reserve(s))
    row = n_feat * target.hidden_size * b + TOKEN_KEY_BYTES
    host = (term("rank processes", s.per_host, HOST_PROCESS_BYTES, "ranks"),
            term("rows on their way to disk", s.per_host * s.batch * s.seq, row, "tokens (a batch per rank)"))
    disk = () if s.tokens is None else (term("hidden cache", s.tokens, row,
                                             f"tokens ({n_feat} x H x {b} B + {TOKEN_KEY_BYTES} B each)"),)
    notes = ("the cache streams to disk one batch at a time in sealed blocks of rows (hidden_cache.py); holding a "
             f"rank's whole share in RAM would take {(s.tokens or 0) * row / s.gpus / GIB:.1f} GiB"
             + ("" if s.tokens else " (give tokens)"),)
    return Stage("cache_build", gpu=gpu, host=host, disk=disk, notes=notes,
                 choices={"base_placement": placement, "bytes_per_token": row})


def trainable_state(params: int, largest: int, s: PlanSettings, who: str) -> tuple[Term, ...]:
    """Bytes per GPU of ``params`` trainable parameters with AdamW under the trainer's preset.

    ``single``/``ddp`` (ZeRO stage 0, HF Trainer with torch autocast): fp32 parameters, fp32 gradients, Adam's
    :data:`ADAM_BYTES`, and under bf16/fp16 autocast's cached half copies of the weights (2 B), all on every rank.
    DeepSpeed (stages 1-3): half parameters and gradients (2 B each; 4 under fp32) and the fp32 master copy (4 B,
    mixed precision only) beside Adam's 8 B; stage 1 shards master + Adam, stage 2 also the gradients, stage 3 also
    the parameters (and gathers one parameter whole at a time: ``largest``), plus two gradient buckets of
    :data:`DS_BUCKET_ELEMENTS`.
    """
    mixed = s.precision != "fp32"
    n, z = s.gpus, s.zero_stage
    if z == 0:
        out = [term(f"{who} params (fp32)", params, 4, "params"), term(f"{who} grads (fp32)", params, 4, "params"),
               term(f"{who} Adam m+v", params, ADAM_BYTES, "params")]
        if mixed:
            out.append(term(f"{who} autocast copies", params, 2, "params"))
        return tuple(out)
    half = 2 if mixed else 4
    out = [term(f"{who} params", params, half, "params", divide=n if z >= 3 else 1),
           term(f"{who} grads", params, half, "params", divide=n if z >= 2 else 1)]
    if mixed:
        out.append(term(f"{who} fp32 master", params, 4, "params", divide=n))
    out.append(term(f"{who} Adam m+v", params, ADAM_BYTES, "params", divide=n))
    if z >= 3:
        out.append(term(f"{who} largest gathered param", largest, half, "params"))
    out.append(term("gradient buckets", 2 * min(DS_BUCKET_ELEMENTS, params), half, "elements"))
    return tuple(out)


def heads_step(target: TargetSizes, heads: HeadsSizes, s: PlanSettings) -> tuple[Term, ...]:
    """The heads' forward and backward of one micro batch: the saved activations (``B x T x passes x widths x
    act``: every weight matrix's input and output per token, :attr:`HeadsSizes.linear_widths`, act 2 B under
    mixed precision, 4 under fp32) and the loss's peak (``2 x loss_chunk_size x V' x 4``: one chunk's fp32 logits
    and their gradient)."""
    act = 2 if s.precision != "fp32" else 4
    tokens = s.batch * s.seq
    return (term("heads activations", tokens * heads.passes * heads.linear_widths, act,
                 f"token-widths ({tokens} tokens x {heads.passes} passes x {heads.linear_widths})"),
            loss_logits(heads, s, tokens))


def loss_logits(heads: HeadsSizes, s: PlanSettings, tokens: int) -> Term:
    """The loss's fp32 logits and their gradient: one chunk of ``loss_chunk_size`` rows at a time, or with
    ``loss_chunk_size=0`` (off) every head's row of every token at once (``2 x tokens x K x V' x 4``)."""
    if s.loss_chunk_size == 0:
        rows = tokens * heads.num_heads
        return term("loss logits + grad (unchunked)", 2 * rows * heads.out_size, 4,
                    f"logits (2 x {tokens} tokens x K {heads.num_heads} x V' {heads.out_size})")
    return term("loss logits chunk + grad", 2 * s.loss_chunk_size * heads.out_size, 4,
                f"logits (2 x loss_chunk_size {s.loss_chunk_size} x V' {heads.out_size})")


def base_loss_logits(target: TargetSizes, s: PlanSettings, tokens: int) -> Term:
    """Medusa-2's base loss over the full vocabulary V: with ``loss_chunk_size`` > 0 one chunk of positions at a time
    (its fp32 logits, the original model's for ``kl``, and their gradient: ``3 x chunk x V x 4``,
    :func:`~medusa_train.training.joint_loss.chunked_base_loss_sum`); with 0, or with ``soft`` targets (the heads
    read the base's distribution at every position), the batch's logits (``B x T x V x 4``)."""
    if s.loss_chunk_size and not s.soft_targets:
        rows = min(s.loss_chunk_size, tokens)
        return term("base loss logits chunk (+ original, grad)", 3 * rows * target.vocab_size, 4,
                    f"logits (3 x {rows} positions x V)")
    return term("base loss logits", tokens * target.vocab_size, 4, f"logits ({tokens} tokens x V)")


def base_activations(target: TargetSizes, s: PlanSettings, tokens: int) -> tuple[Term, ...]:
    """What Medusa-2's base saves for its backward pass: every linear map's input and output of every layer
    (``L x tokens x widths x 2 B``), or with gradient checkpointing each layer's input (``L x tokens x H x 2 B``)
    plus one layer recomputed at a time (``tokens x widths x 2 B``)."""
    if not s.gradient_checkpointing:
        return (term("base activations (with grad)", target.num_layers * tokens * target.linear_widths, 2,
                     f"token-widths ({target.num_layers} layers x {tokens} tokens x {target.linear_widths})"),)
    return (term("base layer inputs (checkpointed)", target.num_layers * tokens * target.hidden_size, 2,
                 f"values ({target.num_layers} layers x {tokens} tokens x H)"),
            term("one base layer recomputed", tokens * target.linear_widths, 2,
                 f"token-widths ({tokens} tokens x {target.linear_widths})"))


def training_stage(target: TargetSizes, heads: HeadsSizes, s: PlanSettings) -> Stage:
    """Training, per GPU: the heads' state (:func:`trainable_state`), their step (:func:`heads_step`) and what they
    read of the base, plus :func:`reserve`.

    - Medusa-1 (frozen base) on the hidden cache: the base's lm_head and input embeddings (``FrozenBase`` keeps
      both; Hydra and EAGLE-3 read the embeddings, shared lm_heads the projection) and the batch's features read
      from the cache (``features x B x T x H``);
    - Medusa-1 without the cache: the base (:func:`base_weights`) and its no-grad forward (:func:`base_forward`);
    - Medusa-2: the base ZeRO-3-sharded (its shard and largest gathered block), the LoRA adapters' state
      (``r x (in + out)`` per adapted map and layer; the whole base's with ``finetune=full``), the activations a
      backward through every base layer needs (``layers x B x T x widths x 2``) and the base loss's logits
      (:func:`base_loss_logits`).
    """
    b = dtype_bytes(s.base_dtype)
    tokens = s.batch * s.seq
    n_feat = len(heads.features)
    gpu = [*trainable_state(heads.params, heads.largest_param, s, "heads"), *heads_step(target, heads, s)]
    choices = {}
    if s.recipe == JOINT:
        gpu += base_weights(target, s, "zero3" if s.gpus > 1 else "replicated")
        if s.lora_r is None:
            gpu += trainable_state(target.params, target.largest_gathered, s, "base")
        elif s.lora_r > 0:
            names = s.lora_targets or ("q_proj", "k_proj", "v_proj", "o_proj")
            width = sum(target.lora_widths.get(n, 0) for n in names)
            lora = s.lora_r * width * target.num_layers
            gpu += trainable_state(lora, s.lora_r * max(target.lora_widths.values()), s, "LoRA")
        gpu += [*base_activations(target, s, tokens), base_loss_logits(target, s, tokens)]
    elif s.hidden_cache:
        gpu += [term("base lm_head + embeddings", target.embed + target.lm_head, b, "params"),
                term("cached features of a batch", n_feat * tokens * target.hidden_size, b,
                     f"values ({n_feat} features x {tokens} tokens x H)")]
    else:
        forward = base_forward(target, s, n_feat)
        rest = sum(t.bytes for t in gpu) + sum(t.bytes for t in forward) + reserve(s).bytes
        placement = choose_placement(target, s, rest)
        gpu += [*base_weights(target, s, placement), *forward]
        choices["base_placement"] = placement
    gpu.append(reserve(s))
    host = (term("rank processes", s.per_host, HOST_PROCESS_BYTES, "ranks"),)
    choices["zero_stage"] = s.zero_stage
    return Stage("training", gpu=tuple(gpu), host=host, choices=choices)


def export_stage(heads: HeadsSizes, s: PlanSettings) -> Stage:
    """The export: the main process keeps the trained fp32 weights on its host (``gather_trainable_state``; the other
    ranks take part in DeepSpeed's gathers and drop each weight), and its safetensors write serialises them once more
    (``params x 4`` each); GPUs hold nothing new."""
    host = (term("gathered fp32 heads (main process)", heads.params, 4, "params"),
            term("safetensors buffer", heads.params, 4, "params"),
            term("rank processes", s.per_host, HOST_PROCESS_BYTES, "ranks"))
    return Stage("export", host=host)


__all__ = ["ADAM_BYTES", "CPU_RESERVE_BYTES", "CUDA_RESERVE_BYTES", "DS_BUCKET_ELEMENTS", "HOST_PROCESS_BYTES",
           "TOKEN_KEY_BYTES", "VLLM_ACTIVATION_MARGIN_BYTES", "VLLM_MAX_UTILIZATION", "base_forward", "base_weights",
           "cache_build_stage", "choose_placement", "export_stage", "reserve", "self_distill_stage", "trainable_state",
           "training_stage"]
