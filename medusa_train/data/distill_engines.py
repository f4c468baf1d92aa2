"""Where self-distillation's replies come from (``data.self_distill_engine``): a
:data:`~medusa_train.data.self_distill.GenerateFn` per engine, all fed our chat template's prompt ids.

- ``hf``: ``generate`` on the training model (:func:`medusa_train.models.generation.greedy_generate`), left-padded batches.
- ``vllm``: vLLM in its own environment (:class:`medusa_train.engines.vllm_env.VllmWorker`), started here and stopped
  when self-distillation ends, which runs before the training base loads (the engines have the GPUs to themselves:
  ``data.self_distill_gpu_memory_utilization``). On a CPU one engine per rank; on GPUs one engine per group of
  ``data.self_distill_tensor_parallel_size`` GPUs of a node, started by the group's first local rank with
  ``CUDA_VISIBLE_DEVICES`` naming the group's GPUs (:func:`engine_placement`; planned, not run here: this machine
  has no GPU, the assignment is tested as a pure function); prompts go as token ids, greedy, EOS exactly our stop ids.
  vLLM decodes ``generation_batch_size`` sequences at once and gets :data:`QUEUED_BATCHES` times as many prompts
  per request (:func:`request_size`): a finished reply's slot is refilled from the queue at once instead of idling
  until the request's longest reply ends. On a CPU the engine runs eager (``enforce_eager``; CUDA keeps its
  compiled graphs) with every core computing (``reserved_cpus=0``: our process only waits for the replies). On the
  quickstart's 520 prompts (bf16, 2-core Intel Xeon with AMX, Intel OpenMP preloaded as the worker does): the
  compiled engine started in 125 s (85 s of them the compile), the eager one in 20 s and then decoded as fast
  (632 tokens/s in one request, one compute core); every core computing, 746 tokens/s.
- ``server``: an OpenAI-compatible completions server a user already runs (``data.server_url``), prompts as token
  ids. Servers that send the reply's token ids back (vLLM: ``return_token_ids``) give the same records as ``vllm``;
  for the others the reply's text is re-encoded, so ``new_tokens`` can differ by a token or two.

A server that is down or answers garbage raises :class:`~medusa_train.engines.openai_client.ServerError` naming the URL;
records written before stay (each batch is flushed), so a rerun resumes after them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from medusa_train.config.schema import DataConfig, ModelConfig
from medusa_train.data.self_distill import GenerateFn
from medusa_train.config.precision import AUTO, choose_dtype

log = logging.getLogger(__name__)

QUEUED_BATCHES = 8
"""Prompts per request to vLLM or a server, in ``generation_batch_size`` units. Every request ends in a drain (its
last replies decode with the batch emptying): on the quickstart's 520 prompts (vLLM 0.32, bf16, eager, 128
sequences at once, 2-core Intel Xeon with AMX) one batch per request made 439 new tokens/s, every prompt in one
request 541, two requests of 260 about 450. Records are written and flushed per request, so a killed step loses at
most one request's replies (1,024 prompts at ``generation_batch_size=128``: about 4 minutes of generation there)."""


def request_size(data: DataConfig) -> int:
    """Prompts per ``generate`` call of ``data``'s engine: ``generation_batch_size`` for ``hf`` (one padded batch),
    :data:`QUEUED_BATCHES` times that for vLLM and servers (continuous batching)."""
    return data.generation_batch_size * (1 if data.distill_engine == "hf" else QUEUED_BATCHES)


@dataclass(frozen=True)
class EnginePlacement:
    """Which rank starts a vLLM engine for self-distillation, on which GPUs, and whose conversations it answers.

    Attributes:
        launches: this rank starts an engine (the others of its group wait at the barrier).
        cuda_visible_devices: the engine's GPUs, as its worker's ``CUDA_VISIBLE_DEVICES`` (None: on the CPU, the
            environment's left as is).
        engine_rank, engines: the engine's share of the conversations: index i goes to engine ``i % engines``
            (:func:`~medusa_train.data.self_distill.self_distill`'s ``rank`` and ``world_size``).
        tensor_parallel_size: GPUs per engine (vLLM's ``tensor_parallel_size``).
    """

    launches: bool
    cuda_visible_devices: str | None
    engine_rank: int
    engines: int
    tensor_parallel_size: int = 1


def engine_placement(rank: int, local_rank: int, world_size: int, gpus_per_node: int, tensor_parallel_size: int = 1,
                     visible_devices: str | None = None) -> EnginePlacement:
    """Where this rank's self-distillation engine runs (pure).

    On the CPU (``gpus_per_node=0``) every rank starts its own engine (``tensor_parallel_size`` must be 1). On GPUs
    the node's GPUs go in groups of ``tensor_parallel_size``: local rank ``l`` belongs to group ``l // tp`` (GPUs
    ``tp * (l // tp)`` to ``tp * (l // tp) + tp - 1``, indices into ``visible_devices``, the training process's own
    ``CUDA_VISIBLE_DEVICES``, when it is set) and starts the group's engine when ``l % tp == 0``; engine ``rank //
    tp`` of ``world_size // tp`` (torchrun numbers a node's ranks contiguously).

    Raises:
        ValueError: naming ``data.self_distill_tensor_parallel_size``: it does not divide the GPUs of a node or the
            world size, or is above 1 on the CPU; or more local ranks than GPUs.
    """
    tp = tensor_parallel_size
    field = "data.self_distill_tensor_parallel_size"
    if tp < 1:
        raise ValueError(f"{field} must be at least 1, got {tp}")
    if gpus_per_node == 0:
        if tp != 1:
            raise ValueError(f"{field}={tp} needs GPUs; on the CPU every rank runs its own engine: set it to 1")
        return EnginePlacement(True, None, rank, world_size, 1)
    if gpus_per_node % tp or world_size % tp:
        raise ValueError(f"{field}={tp} must divide the GPUs of a node ({gpus_per_node}) and the number of ranks "
                         f"({world_size}): e.g. 1, 2, 4 or 8 on an 8-GPU node")
    if not 0 <= local_rank < gpus_per_node:
        raise ValueError(f"local rank {local_rank} has no GPU of its own ({gpus_per_node} GPUs on this node): start at "
                         "most one rank per GPU")
    devices = visible_devices.split(",") if visible_devices else [str(d) for d in range(gpus_per_node)]
    first = local_rank // tp * tp
    return EnginePlacement(local_rank % tp == 0, ",".join(devices[first : first + tp]), rank // tp, world_size // tp, tp)


def engine_placement_here(data: DataConfig, rank: int, world_size: int) -> EnginePlacement:
    """:func:`engine_placement` for this process (``LOCAL_RANK``, the CUDA devices it sees, ``CUDA_VISIBLE_DEVICES``)
    when ``data`` distills with vLLM; every other engine answers each rank's own share (``rank`` of
    ``world_size``)."""
    if data.distill_engine != "vllm":
        return EnginePlacement(True, None, rank, world_size, 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return engine_placement(rank, int(os.environ.get("LOCAL_RANK", rank)), world_size, gpus,
                            data.self_distill_tensor_parallel_size, os.environ.get("CUDA_VISIBLE_DEVICES"))


def vllm_generate(worker: Any) -> GenerateFn:
    """Greedy replies from a started :class:`~medusa_train.engines.vllm_env.VllmWorker`."""

    def generate(prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> list[tuple[list[int], bool]]:
        reply = worker.generate(prompts, max_new_tokens, sorted(stop_ids))
        return [(list(o["token_ids"]), o["finish_reason"] == "stop") for o in reply["outputs"]]

    return generate


def server_generate(url: str, model: str, tokenizer: Any) -> GenerateFn:
    """Greedy replies from the OpenAI-compatible server at ``url`` serving ``model``."""
    from medusa_train.engines.openai_client import complete

    def generate(prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> list[tuple[list[int], bool]]:
        replies = []
        for c in complete(url, model, prompts, max_new_tokens, sorted(stop_ids), vocab_size=len(tokenizer)):
            ids = c.token_ids if c.token_ids is not None else list(
                tokenizer(c.text, add_special_tokens=False).input_ids)
            replies.append((ids, c.finished))
        return replies

    return generate


@contextmanager
def distill_engine(data: DataConfig, model: Any, tokenizer: Any, model_config: ModelConfig | None,
                   max_prompt_tokens: int, placement: EnginePlacement | None = None,
                   ) -> Iterator[tuple[GenerateFn | None, str]]:
    """The engine ``data`` asks for, for the length of a ``with`` block: ``(generate, description)``; ``generate``
    is None for ``hf`` (self-distillation's own default).

    Args:
        data: the ``data/`` config (``self_distill_engine``, ``server_url``, ``self_distill_dtype``, ...).
        model: the loaded training model (its dtype is vLLM's unless ``self_distill_dtype`` says otherwise).
        tokenizer: its tokenizer (re-encodes a text-only server's replies).
        model_config: the ``model/`` config vLLM loads the same base from (required for ``vllm``).
        max_prompt_tokens: the longest prompt sent (vLLM reserves it + ``max_new_tokens`` per sequence).
        placement: vLLM's GPUs and tensor parallelism (:func:`engine_placement_here`); None: the CPU's default.

    Raises:
        VllmUnavailable: ``vllm`` without vLLM's environment (the install command named), before anything starts.
        ServerError: ``server`` and the server is unreachable or serves no model (URL named).
        VllmError: vLLM failed to start (its error and log named).
    """
    engine = data.distill_engine
    if engine == "hf":
        yield None, f"hf generate ({str(model.dtype).removeprefix('torch.')})"
        return
    if engine == "server":
        from medusa_train.engines.openai_client import served_model

        name = data.server_model or served_model(data.server_url)
        yield server_generate(data.server_url, name, tokenizer), f"server {data.server_url} ({name})"
        return
    from medusa_train.engines.vllm_env import VllmWorker, vllm_python
    from medusa_train.loading.base import engine_model_path

    vllm_python()  # fail with the install command before converting or starting anything
    if model_config is None:
        raise ValueError("data.self_distill_engine=vllm needs the base model's config to start vLLM")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = data.self_distill_dtype or str(model.dtype).removeprefix("torch.")
    if dtype == AUTO:  # bf16 where the hardware multiplies it natively (a GPU, a CPU with AVX-512 BF16 / AMX)
        dtype = choose_dtype(AUTO, device).name
    on_cpu = device == "cpu"  # eager, every core computing: see the module docstring
    path = engine_model_path(model_config)
    started: list[Any] = []  # the engine, once the first batch needs it
    answer: list[GenerateFn] = []

    def generate(prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> list[tuple[list[int], bool]]:
        # Started at the first batch to answer: a resumed run whose replies are all written starts no engine.
        if not started:
            gpu = {} if on_cpu or placement is None else dict(
                cuda_visible_devices=placement.cuda_visible_devices,
                tensor_parallel_size=placement.tensor_parallel_size,
                gpu_memory_utilization=data.self_distill_gpu_memory_utilization)
            started.append(VllmWorker(path, dtype=dtype, max_num_seqs=data.generation_batch_size,
                                      max_model_len=max_prompt_tokens + data.max_new_tokens, enforce_eager=on_cpu,
                                      reserved_cpus=0 if on_cpu else None, **gpu))
            answer.append(vllm_generate(started[0]))
            log.info("self-distillation through vllm %s (%s, %s%s); its log: %s", started[0].vllm_version, path,
                     dtype, ", eager" if on_cpu else "", started[0].log_path)
        return answer[0](prompts, max_new_tokens, stop_ids)

    try:
        yield generate, f"vllm ({dtype})"
    finally:
        for worker in started:
            worker.close()


__all__ = ["QUEUED_BATCHES", "EnginePlacement", "distill_engine", "engine_placement", "engine_placement_here", "request_size", "server_generate", "vllm_generate"]
