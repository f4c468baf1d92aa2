"""The vLLM worker: run by the python of vLLM's own environment (``launch/install_vllm.sh``), never imported by ours.

vLLM pins its own torch and an older transformers, so it cannot live in the project's environment. This script is
the only code that imports vLLM: :class:`medusa_train.engines.vllm_env.VllmWorker` starts it as a subprocess, sends one
JSON request per line on its stdin and reads one JSON reply per line. It imports nothing of medusa-train (a
different transformers is installed here). Everything vLLM itself prints goes to stderr: the original stdout is
kept for replies only.

Requests (``op``) and replies (``{"ok": true, ...}`` or ``{"ok": false, "error", "traceback"}``):

- ``start``: ``model`` (an HF folder or Hub id), ``dtype``, ``speculative_config`` (None, or vLLM's dict, e.g.
  ``{"method": "medusa", "model": <export>/vllm, "num_speculative_tokens": K}``, or ``{"method": "eagle3",
  "model": <export>/speculators, "num_speculative_tokens": K}``), ``max_model_len``,
  ``max_num_seqs``, ``enforce_eager``, ``seed``, ``gpu_memory_utilization`` and ``tensor_parallel_size`` (CUDA
  only; the GPUs are the process's ``CUDA_VISIBLE_DEVICES``) -> ``vllm_version``,
  ``start_s``. The engine is built once and reused by every later request (starting it takes 30-180 s on a CPU).
- ``generate``: ``prompts`` (lists of token ids: the chat template is applied by the caller, so both sides see the
  same ids), ``max_tokens``, ``stop_token_ids`` (the only ids that end a reply: ``ignore_eos`` is set), optional
  ``temperature``, ``top_p``, ``top_k``, ``seed`` -> ``outputs`` (per prompt: ``token_ids``, stop token included;
  ``finish_reason`` "stop" or "length"; ``first_token_s``), ``wall_s`` (the ``LLM.generate`` call) and ``spec``:
  vLLM's speculative-decoding counters accumulated during the call (``num_drafts``, ``num_draft_tokens``,
  ``num_accepted_tokens``, ``accepted_per_pos``: per draft position j, the drafts whose token j was accepted; zeros
  without speculation). The counters are the same for every method (``vllm:spec_decode_*`` of ``get_metrics``).
- ``drafts``: ``hidden`` (a safetensors file with ``hidden [N, H]``: target hidden states after the final norm) ->
  ``drafts [N, K]``: the token each Medusa head proposes, computed by the drafter vLLM loaded, exactly as its
  ``MedusaProposer.propose`` does (``model(hidden)``, ``compute_logits``, argmax). Only with ``start`` given
  ``inspect: true`` (the engine then runs in this process, so its drafter can be reached).
- ``shutdown``: reply, then exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # this folder is not a package to import from


class Worker:
    def __init__(self) -> None:
        self.llm = None
        self.inspect = False

    def start(self, req: dict) -> dict:
        if self.llm is not None:
            raise RuntimeError("the engine is already started")
        self.inspect = bool(req.get("inspect", False))
        if self.inspect:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: drafter reachable
        import vllm
        from vllm import LLM

        kwargs = dict(model=req["model"], dtype=req.get("dtype", "auto"), seed=int(req.get("seed", 0)),
                      max_model_len=req.get("max_model_len"), max_num_seqs=int(req.get("max_num_seqs", 8)),
                      enforce_eager=bool(req.get("enforce_eager", False)),
                      speculative_config=req.get("speculative_config"), disable_log_stats=False,
                      skip_tokenizer_init=True, generation_config="vllm")
        if int(req.get("tensor_parallel_size", 1)) > 1:  # GPUs only (planned, not run here)
            kwargs["tensor_parallel_size"] = int(req["tensor_parallel_size"])
        if req.get("gpu_memory_utilization") is not None:
            kwargs["gpu_memory_utilization"] = float(req["gpu_memory_utilization"])
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        return {"vllm_version": vllm.__version__, "start_s": time.perf_counter() - t0}

    def _spec_counters(self) -> dict:
        totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
        for metric in self.llm.get_metrics():
            key = metric.name.removeprefix("vllm:spec_decode_")
            if key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                totals[key] += int(metric.value)
            elif key == "num_accepted_tokens_per_pos":
                values = [int(v) for v in metric.values]
                old = totals["accepted_per_pos"]
                totals["accepted_per_pos"] = [a + b for a, b in zip(values, old + [0] * (len(values) - len(old)))]
        return totals

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._engine()
        top_k = int(req.get("top_k", 0))
        params = SamplingParams(
            max_tokens=int(req["max_tokens"]), temperature=float(req.get("temperature", 0.0)),
            top_p=float(req.get("top_p", 1.0)), top_k=top_k if top_k > 0 else -1, seed=req.get("seed"),
            stop_token_ids=[int(t) for t in req.get("stop_token_ids", [])], ignore_eos=True, detokenize=False,
        )
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in req["prompts"]]
        before = self._spec_counters()
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = self._spec_counters()
        spec = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        old = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
        spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], old)]
        outputs = []
        for r in results:
            out = r.outputs[0]
            first = getattr(r.metrics, "first_token_latency", None) if r.metrics is not None else None
            outputs.append({"token_ids": list(out.token_ids), "finish_reason": out.finish_reason,
                            "first_token_s": first})
        return {"outputs": outputs, "wall_s": wall, "spec": spec}

    def drafts(self, req: dict) -> dict:
        import torch
        from safetensors.torch import load_file

        llm = self._engine()
        if not self.inspect:
            raise RuntimeError("drafts needs the engine started with inspect=true")
        hidden = load_file(req["hidden"])["hidden"]

        def propose(worker):  # what vllm/v1/spec_decode/medusa.py MedusaProposer.propose computes
            drafter = worker.model_runner.drafter
            model = drafter.model
            weight = next(model.parameters())
            with torch.inference_mode():
                logits = model.compute_logits(model(hidden.to(device=weight.device, dtype=weight.dtype)))
            return torch.stack([x.argmax(dim=-1) for x in logits], dim=1).cpu().tolist()

        return {"drafts": llm.collective_rpc(propose)[0]}

    def _engine(self):
        if self.llm is None:
            raise RuntimeError("send op=start first")
        return self.llm


def main() -> None:
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints and logs go to stderr; stdout carries replies only
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        op = None
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "shutdown":
                reply.write(json.dumps({"ok": True}) + "\n")
                break
            if op not in ("start", "generate", "drafts"):
                raise ValueError(f"unknown op {op!r}")
            answer = getattr(worker, op)(req)
            reply.write(json.dumps({"ok": True, **answer}) + "\n")
        except Exception as e:  # every failure goes back to the caller, who raises it with the request named
            reply.write(json.dumps({"ok": False, "op": op, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}) + "\n")
    reply.flush()
    if worker.llm is not None:
        try:
            worker.llm.llm_engine.engine_core.shutdown()  # stops the engine-core process (multiprocessing mode)
        except Exception:  # noqa: BLE001 - exiting anyway; the engine core also exits when its parent does
            traceback.print_exc()
    os._exit(0)  # vLLM's engine threads and atexit hooks can hang a normal exit; replies are flushed


if __name__ == "__main__":
    main()
