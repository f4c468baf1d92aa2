"""Medusa-2: the base model and the heads in one module, trained together (LoRA, full or frozen base).

Source: Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (2024,
arXiv:2401.10774), Sec. 2.2.2 "Medusa-2: Joint Training" (the base keeps its language-model loss while the heads
train on its hidden states, with a larger learning rate for the heads and a warmed-up head weight) and Sec. 2.3.2
(self-distillation: on data the model wrote itself the base loss is the KL divergence to the original model).

:func:`prepare_base` turns the loaded base into what the optimizer trains: peft LoRA adapters (``lora``), every
weight (``full``) or nothing (``frozen``). :class:`JointModel` runs the backbone once per batch and returns the
base logits and the head logits of the same hidden states; with ``with_reference`` it also returns the original
model's logits, computed by the same module with its adapters disabled (``PeftModel.disable_adapter``) under
``no_grad``: no second copy of the base is held. Full fine-tuning has no such switch, so KL with ``finetune=full`` is
refused by the config (it would need a frozen copy, doubling the base's memory).

Everything runs inside :meth:`JointModel.forward`, so DeepSpeed ZeRO-3's parameter-gathering hooks see every
call (backbone, lm_head, heads). The base's chunked loss reads the lm_head's weight outside its module: where ZeRO-3
partitions it, it is gathered for that loss's forward and backward passes
(:func:`~medusa_train.training.base_placement.gathered`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from medusa_train.models.catalog import ProjectFn
from medusa_train.config.schema import HeadsConfig
from medusa_train.models.features import FINAL, target_features
from medusa_train.models.speculative import DraftHeads
from medusa_train.training.base_placement import gathered, is_partitioned
from medusa_train.training.chunked_loss import chunked_argmax
from medusa_train.training.joint_loss import base_loss_sum, chunked_base_loss_sum

# model_type -> LoRA targets: the attention projections (Hu et al. 2021 adapt W_q, W_v; QLoRA-style recipes all four).
# Add the MLP (gate_proj, up_proj, down_proj) through heads.lora.target_modules.
DEFAULT_LORA_TARGETS: dict[str, list[str]] = {
    **{family: ["q_proj", "k_proj", "v_proj", "o_proj"]
       for family in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo",
                      "olmo2", "granite", "smollm3")},
    "gpt2": ["c_attn", "c_proj"],
    "gpt_neox": ["query_key_value", "dense"],
    "phi3": ["qkv_proj", "o_proj"],
}


def _is_linear(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D  # GPT-2's transposed linear layer

    return isinstance(module, (nn.Linear, Conv1D))


def linear_module_names(model: nn.Module) -> list[str]:
    """Sorted distinct leaf names (``q_proj``, ``c_attn``...) of the linear layers of ``model`` (lm_head excluded)."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if _is_linear(m) and m is not lm_head and name})


def lora_target_modules(model: PreTrainedModel, requested: list[str] | None) -> list[str]:
    """The LoRA targets for ``model``: ``requested``, or its family's default; every one checked to exist.

    Raises:
        ValueError: no default for ``model.config.model_type`` and none requested, or a requested name that is no
            linear layer of the model (the missing names and the available linear names are listed; field
            ``heads.lora.target_modules``).
    """
    available = linear_module_names(model)
    model_type = getattr(model.config, "model_type", None)
    if requested is None:
        if model_type not in DEFAULT_LORA_TARGETS:
            raise ValueError(f"no default LoRA targets for model_type={model_type!r}: set heads.lora.target_modules "
                             f"to some of its linear layers {available}")
        requested = DEFAULT_LORA_TARGETS[model_type]
    missing = [name for name in requested if name not in available]
    if missing:
        raise ValueError(f"heads.lora.target_modules: {missing} are not linear layers of this {model_type} model; "
                         f"its linear layers are {available}")
    return list(requested)


def prepare_base(base: PreTrainedModel, heads_cfg: HeadsConfig) -> nn.Module:
    """Make ``base`` trainable as ``heads.finetune`` asks, in place; returns the module to train.

    - ``lora``: a peft ``PeftModel`` with adapters on :func:`lora_target_modules` (B = 0 at start, so the model is
      the original until a step changes it); only the adapters require grad.
    - ``full``: ``base`` with every parameter requiring grad.
    - ``frozen``: ``base`` unchanged (no parameter requires grad).

    Raises:
        ValueError: an unknown ``finetune`` value or bad LoRA targets (see :func:`lora_target_modules`).
    """
    if heads_cfg.finetune == "frozen":
        return base.requires_grad_(False)
    if heads_cfg.finetune == "full":
        return base.requires_grad_(True)
    if heads_cfg.finetune != "lora":
        raise ValueError(f"heads.finetune must be lora, full or frozen, got {heads_cfg.finetune!r}")
    from peft import LoraConfig, get_peft_model

    lc = heads_cfg.lora
    targets = lora_target_modules(base, lc.target_modules)
    config = LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM",
                        fan_in_fan_out=getattr(base.config, "model_type", None) == "gpt2")  # Conv1D stores W^T
    return get_peft_model(base, config)


def is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional for Medusa-1
        return False
    return isinstance(model, PeftModel)


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The ``*ForCausalLM`` inside a ``PeftModel`` (adapters injected in its layers), or ``model`` itself."""
    return model.get_base_model() if is_peft(model) else model


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of the parameters that require grad (tied weights once), by name."""
    return {name: p.detach().cpu().contiguous().clone() for name, p in model.named_parameters() if p.requires_grad}


def check_trainable_names(model: nn.Module, names: Iterable[str], source: str) -> None:
    """``names`` are exactly the trainable parameters of ``model`` (as :func:`trainable_state` names them).

    Raises:
        ValueError: missing or unexpected names (the first five of each listed, ``source`` named).
    """
    params = {name for name, p in model.named_parameters() if p.requires_grad}
    given = set(names)
    missing, unexpected = sorted(params - given), sorted(given - params)
    if missing or unexpected:
        raise ValueError(f"{source}: trainable weights do not match the model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}); was it written with other heads/finetune settings?")


def load_trainable_state(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into the trainable parameters of ``model``, strictly.

    Raises:
        ValueError: missing or unexpected names (listed), or a shape that differs.
    """
    check_trainable_names(model, state, source)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.shape != state[name].shape:
                raise ValueError(f"{source}: {name} has shape {tuple(state[name].shape)}, the model {tuple(p.shape)}")
            p.copy_(state[name])


@dataclass(frozen=True)
class BaseLossRequest:
    """The base's loss computed inside :meth:`JointModel.forward`, ``chunk_size`` positions at a time, in place
    of its logits (:func:`~medusa_train.training.joint_loss.chunked_base_loss_sum`).

    Attributes:
        kind: ``lm`` or ``kl`` (``heads.base_loss``).
        labels: ``[B, T]`` long, -100 off the assistant turns (not shifted).
        chunk_size: positions projected onto the vocabulary at once (``trainer.loss_chunk_size``, >= 1).
        argmax: also the base's greedy tokens ``[B, T]`` (the heads' ``base_argmax`` targets), in chunks too.
    """

    kind: str
    labels: torch.Tensor
    chunk_size: int
    argmax: bool = False


@dataclass
class JointOutput:
    """One :meth:`JointModel.forward`.

    Attributes:
        logits: ``[B, T, V]`` base logits (with gradient when the base trains), in the lm_head's dtype; None when
            the base's loss was computed in chunks (never held whole).
        head_logits: ``[K, B, T, V']`` head logits of the same hidden states, or ``[K, M, V']`` at the M
            ``positions`` given to :meth:`JointModel.forward`; None with ``head_loss_for``.
        reference_logits: ``[B, T, V]`` logits of the original model (adapters disabled, no gradient), or None.
        head_loss: what the heads' ``project_fn`` returned (with ``head_loss_for``: the chunked heads' loss), else
            None.
        base_loss: with a :class:`BaseLossRequest`: ``(loss sum, counted positions)``, float32 scalars (as
            :func:`~medusa_train.training.joint_loss.base_loss_sum` returns); else None.
    """

    logits: torch.Tensor | None
    head_logits: torch.Tensor | None
    reference_logits: torch.Tensor | None = None
    head_loss: Any = None
    base_loss: tuple[torch.Tensor, torch.Tensor] | None = None


class JointModel(nn.Module):
    """The trainable base (``PeftModel`` or ``*ForCausalLM``) and heads of a ``joint`` type (Medusa heads), as one
    ``nn.Module``.

    Args:
        base: the result of :func:`prepare_base`.
        heads: heads made for this base (hidden size and vocabulary checked by the caller).

    Parameter names start with ``base.`` and ``heads.``; the Trainer's optimizer groups use that split. Its
    checkpoints hold the trainable weights only (:func:`trainable_state`), which :meth:`load_state_dict` with
    ``strict=False`` (the HF Trainer's resume) loads back.
    """

    def __init__(self, base: nn.Module, heads: DraftHeads) -> None:
        super().__init__()
        self.base = base
        self.heads = heads

    @property
    def spec(self):  # the heads' HeadsSpec, as on MedusaHeads (DrafterTrainer reads model.spec)
        return self.heads.spec

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                                        **options: Any) -> None:
        """The HF Trainer's hook for ``+trainer.extra.gradient_checkpointing=true``: the base's decoder layers keep
        only their inputs and recompute the rest in the backward pass (transformers' own checkpointing, ``options``
        such as ``every_n_layers`` passed on; the heads, one block each, are not checkpointed). Non-reentrant by
        default, so gradients reach the LoRA adapters through a frozen embedding. What it saves at 70B:
        ``docs/scale.md``."""
        kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        base = self.base
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(kwargs, **options)
        else:  # transformers before 5.2x (the GPU image's 5.17): the older name
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None,
                                      **options: Any) -> None:
        """:meth:`activation_checkpointing_enable` under the name older Trainers call (transformers 5.17)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **options)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; with ``strict=False``, a checkpoint of the trainable weights (the HF
        Trainer resumes from one so): every trainable parameter and nothing else, checked before anything is copied;
        the frozen weights (never saved) and the buffers are left as they are and not reported missing.

        Raises:
            ValueError: ``strict=False`` and names other than the trainable parameters' (listed).
            RuntimeError: a shape that differs (``nn.Module``'s).
        """
        if strict:
            return super().load_state_dict(state_dict, strict=True, assign=assign)
        check_trainable_names(self, state_dict, "the checkpoint's model weights")
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        return type(result)(missing_keys=[], unexpected_keys=[])

    def _lm_head(self) -> nn.Module:
        return causal_lm(self.base).get_output_embeddings()

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The backbone's last hidden states ``[B, T, H]``, after the final norm."""
        features, _ = target_features(causal_lm(self.base).base_model, input_ids, attention_mask=attention_mask,
                                      use_cache=False)
        return features[FINAL]

    def _reference_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          hidden: torch.Tensor) -> torch.Tensor:
        """The original model's last hidden states (no gradient): the adapters disabled, or ``hidden`` itself for a
        frozen base.

        Raises:
            ValueError: a fully fine-tuned base (no original to switch back to).
        """
        if is_peft(self.base):
            with torch.no_grad(), self.base.disable_adapter():
                return self._hidden(input_ids, attention_mask)
        if not any(p.requires_grad for p in self.base.parameters()):
            return hidden.detach()
        raise ValueError("the original model's logits need LoRA adapters to disable (heads.finetune=lora) "
                         "or a frozen base; a fully fine-tuned base has no original to compare with")

    def _chunkable(self) -> bool:
        """Whether the base's loss can project through the lm_head's weight in chunks: a plain linear map without
        bias, and not both ZeRO-3 partitioned and trained (its gradient would reach a partitioned parameter outside
        DeepSpeed's hooks; ``heads.finetune=full`` under ZeRO-3 keeps the logits whole)."""
        lm_head = self._lm_head()
        return (type(lm_head) is nn.Linear and lm_head.bias is None
                and not (is_partitioned(lm_head.weight) and lm_head.weight.requires_grad))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                with_reference: bool = False,
                positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                head_loss_for: Callable[[torch.Tensor | None, torch.Tensor | None], ProjectFn] | None = None,
                base_loss: BaseLossRequest | None = None) -> JointOutput:
        """One backbone pass: ``input_ids [B, T]`` long (+ ``attention_mask [B, T]``) -> :class:`JointOutput`.

        ``with_reference``: also the original model's logits (a second pass with the adapters disabled, under
        ``no_grad``); without adapters (``frozen``) these are the logits themselves, detached.
        ``positions``: ``(b, t)``, each ``[M]`` long: run the heads only there (the positions some head is trained
        on, :func:`~medusa_train.training.step.counted_positions`), as Medusa-1 training does; None: everywhere.
        ``head_loss_for``: ``(base argmax [B, T] long or None, base logits [B, T, V] detached or None) ->
        project_fn`` (the argmax is given only from the chunked base loss, else it comes from the logits), the
        heads' projection replaced by ``project_fn``
        (:meth:`~medusa_train.drafters.medusa.heads.MedusaHeads.forward`; the chunked loss, whose targets are the
        current base's), its result in :attr:`JointOutput.head_loss`; None: the heads' logits.
        ``base_loss``: the base's loss computed here (:class:`BaseLossRequest`; ``with_reference`` is then implied
        by its ``kl``), in :attr:`JointOutput.base_loss`: in chunks through the lm_head's weight where it is a plain
        linear map and not a trained ZeRO-3 partitioned one (the logits never held whole; ``head_loss_for`` gets the
        argmax when asked for, and no logits); else from the logits, returned whole as without it.

        Raises:
            ValueError: the original model asked of a fully fine-tuned base (no original to switch back to).
        """
        hidden = self._hidden(input_ids, attention_mask)  # [B, T, H]
        lm_head = self._lm_head()
        lm_weight = lm_head.weight if self.heads.spec.share_lm_head else None
        logits = reference = summed = argmax = detached = None
        if base_loss is not None and self._chunkable():
            request, weight = base_loss, lm_head.weight
            original = self._reference_hidden(input_ids, attention_mask, hidden) if request.kind == "kl" else None
            summed = chunked_base_loss_sum(request.kind, weight, hidden, request.labels, request.chunk_size,
                                           reference_hidden=original, gather=lambda: gathered(weight))
            if request.argmax:
                with gathered(weight):
                    argmax = chunked_argmax(lambda rows: rows.to(weight.dtype) @ weight.detach().T, hidden.detach(),
                                            request.chunk_size)
        else:
            logits = lm_head(hidden)
            detached = logits.detach()  # head_loss_for takes its argmax from these, where its targets need it
            if with_reference or (base_loss is not None and base_loss.kind == "kl"):
                original = self._reference_hidden(input_ids, attention_mask, hidden)
                if is_peft(self.base):
                    with torch.no_grad():
                        reference = lm_head(original)
                else:
                    reference = detached
            if base_loss is not None:  # asked for, but the lm_head cannot be projected in chunks
                summed = base_loss_sum(base_loss.kind, logits, base_loss.labels, reference)
        heads_hidden = hidden if positions is None else hidden[positions[0], positions[1]]  # [M, H]
        head_logits = head_loss = None
        if head_loss_for is None:
            head_logits = self.heads(heads_hidden, lm_weight)  # [K, B, T, V'] or [K, M, V']
        else:
            head_loss = self.heads(heads_hidden, lm_weight, project_fn=head_loss_for(argmax, detached))
        return JointOutput(logits=logits, head_logits=head_logits, reference_logits=reference, head_loss=head_loss,
                           base_loss=summed)
