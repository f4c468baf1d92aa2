"""Serve a medusa-train export with vLLM's Medusa speculator, or measure it against plain vLLM decoding. GPU only.

The export's ``vllm/`` folder (``model_type: medusa``, ``blocks.{h}.layers.{l}``, ``lm_heads.{h}``) is the draft
model; the base model comes from ``base_model_name_or_path`` (or ``--base``). vLLM's ``speculative_config`` takes
``{"method": "medusa", "model": <vllm folder>, "num_speculative_tokens": K}``; its Medusa proposer
(``vllm/v1/spec_decode/medusa.py``) drafts one chain, each head's top-1 token, so K is the number of heads and
``medusa_choices.json`` (a tree) is not used by vLLM.

    # offline: plain decoding, then Medusa, same prompts (MT-Bench first turns), greedy; writes a JSON summary
    python benchmarks/serve_vllm.py --export runs/medusa1/export --num-prompts 80 --output vllm_medusa.json
    # an OpenAI-compatible server with the speculator (runs `vllm serve`)
    python benchmarks/serve_vllm.py --export user/medusa-heads --serve --port 8000

Each offline run uses its own process (a finished ``LLM`` does not always hand its GPU memory back). Reported per
run: tokens/s (all new tokens over wall time, one prompt at a time by default: the latency regime speculative
decoding targets), mean accepted tokens per target forward pass (1 + accepted / drafts, vLLM's metrics), and for
Medusa the speedup over plain decoding and the share of replies identical to plain greedy decoding's.

Needs ``pip install vllm`` on a Linux machine with an NVIDIA GPU (vLLM pins a CUDA build of torch; it does not
install on a CPU machine). vLLM is imported only once the arguments are read, so ``--help`` works without it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

NO_VLLM = ("vLLM is not installed in this environment. It needs a Linux machine with an NVIDIA GPU: "
           "`pip install vllm` (or `pip install medusa-train[vllm]`) there; it cannot run on a CPU machine. "
           "The CPU test tests/medusa_train/test_export.py checks the vllm/ folder against vLLM's loading rules.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, help="export folder or Hub repository id (namespace/name)")
    p.add_argument("--revision", default=None, help="Hub revision of --export")
    p.add_argument("--base", default=None, help="base model (default: the export's base_model_name_or_path)")
    p.add_argument("--serve", action="store_true", help="run `vllm serve` with the speculator instead of measuring")
    p.add_argument("--port", type=int, default=8000, help="--serve: port of the OpenAI-compatible server")
    p.add_argument("--prompts", default=None, help="MT-Bench-shaped question.jsonl (default: the assets' MT-Bench)")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=1, help="requests decoded together (1: one at a time)")
    p.add_argument("--dtype", default="auto", help="vLLM dtype of the base model (the heads follow it)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--output", default="vllm_medusa.json", help="offline: where the JSON summary goes")
    p.add_argument("--only", choices=["vanilla", "medusa"], default=None, help=argparse.SUPPRESS)  # child runs
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)  # child runs: where to write its record
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.max_num_seqs < 1:
        p.error("--num-prompts, --max-new-tokens and --max-num-seqs must be >= 1")
    return args


def require_vllm() -> None:
    """Exit with a clear message when vLLM or a CUDA device is missing (before anything is downloaded)."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(NO_VLLM)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("vLLM's Medusa speculator needs a CUDA device and none is visible "
                         "(check nvidia-smi and CUDA_VISIBLE_DEVICES)")


def export_folder(export: str, revision: str | None) -> Path:
    """The local export folder (downloaded from the Hub when ``export`` is a repository id)."""
    from medusa_train.publish.hub import download_export

    return download_export(export, revision)


def speculative_config(folder: Path) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the export in ``folder``.

    Raises:
        SystemExit: no ``vllm/config.json`` (re-export with ``export_vllm=true``).
    """
    vllm_dir = folder / "vllm"
    config_path = vllm_dir / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"{folder} has no vllm/config.json: re-export the heads with export_vllm=true "
                         "(medusa-train writes vllm/ by default)")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "medusa":
        raise SystemExit(f"{config_path}: model_type is {config.get('model_type')!r}, vLLM needs 'medusa'")
    return {"method": "medusa", "model": str(vllm_dir.resolve()), "num_speculative_tokens": int(config["num_heads"])}


def base_model(folder: Path, override: str | None) -> str:
    if override:
        return override
    base = json.loads((folder / "config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise SystemExit(f"{folder}/config.json names no base_model_name_or_path: pass --base")
    return base


def serve_command(base: str, spec: dict[str, Any], args: argparse.Namespace) -> list[str]:
    return ["vllm", "serve", base, "--speculative-config", json.dumps(spec), "--port", str(args.port),
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization)]


def load_messages(path: str | None, num_prompts: int) -> list[list[dict[str, str]]]:
    """First user turns of MT-Bench (or ``path``) as chat conversations."""
    from medusa_train.prompts import load_prompts

    prompts = load_prompts("jsonl" if path else "mt_bench", path=path, num_prompts=num_prompts)
    return [p.first_turn_messages() for p in prompts]


def spec_metrics(llm: Any) -> dict[str, float]:
    """Draft and acceptance counters of vLLM's metrics (``LLM.get_metrics``, V1 engine)."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    for metric in llm.get_metrics():
        key = metric.name.removeprefix("vllm:spec_decode_")
        if key in totals:
            totals[key] += float(metric.value)
    return totals


def run_one(kind: str, base: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    """Decode every prompt with one engine; returns its record (outputs included, for the exact-match check)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=base, speculative_config=spec, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
              disable_log_stats=False, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    conversations = load_messages(args.prompts, args.num_prompts)
    llm.chat(conversations[:1], params, use_tqdm=False)  # warm-up: compile, CUDA graphs
    before = spec_metrics(llm)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(conversations), args.max_num_seqs):
        batch = llm.chat(conversations[i:i + args.max_num_seqs], params, use_tqdm=False)
        outputs.extend(list(o.outputs[0].token_ids) for o in batch)
    wall = time.perf_counter() - start
    after = spec_metrics(llm)
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    new_tokens = sum(len(o) for o in outputs)
    record = {"decoder": kind, "new_tokens": new_tokens, "wall_time_s": wall, "tokens_per_second": new_tokens / wall,
              "mean_accepted_tokens": 1.0 + accepted / drafts if drafts else 1.0, "drafts": drafts,
              "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"], "accepted_tokens": accepted,
              "outputs": outputs}
    del llm
    gc.collect()
    return record


def child(args: argparse.Namespace) -> None:
    folder = export_folder(args.export, args.revision)
    spec = speculative_config(folder) if args.only == "medusa" else None
    record = run_one(args.only, base_model(folder, args.base), spec, args)
    Path(args.result).write_text(json.dumps(record))


def measure(args: argparse.Namespace, argv: list[str], folder: Path) -> dict[str, Any]:
    """Plain decoding then Medusa, each in a child process; returns the summary written to ``--output``."""
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("vanilla", "medusa"):
            result = Path(tmp) / f"{kind}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--only", kind,
                   "--result", str(result)]
            subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            records[kind] = json.loads(result.read_text())
    vanilla, medusa = records["vanilla"], records["medusa"]
    plain, drafted = vanilla.pop("outputs"), medusa.pop("outputs")
    same = sum(a == b for a, b in zip(plain, drafted))
    medusa["speedup"] = medusa["tokens_per_second"] / vanilla["tokens_per_second"]
    medusa["exact_match_vs_greedy"] = same / len(plain)
    vanilla["speedup"], vanilla["exact_match_vs_greedy"] = 1.0, 1.0
    return {"engine": f"vllm {importlib.metadata.version('vllm')}", "model": base_model(folder, args.base),
            "export": args.export, "speculative_config": speculative_config(folder), "prompts": len(plain),
            "max_new_tokens": args.max_new_tokens, "max_num_seqs": args.max_num_seqs, "dtype": args.dtype,
            "decoders": {"vanilla": vanilla, "medusa": medusa}}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    require_vllm()
    if args.only:
        return child(args)
    folder = export_folder(args.export, args.revision)
    spec = speculative_config(folder)
    base = base_model(folder, args.base)
    if args.serve:
        cmd = serve_command(base, spec, args)
        print(" ".join(cmd[:4]) + f" '{cmd[4]}' " + " ".join(cmd[5:]), flush=True)
        os.execvp(cmd[0], cmd)
    summary = measure(args, argv, folder)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    m = summary["decoders"]["medusa"]
    print(f"Medusa (K={spec['num_speculative_tokens']}) on {base}: {m['tokens_per_second']:.1f} tokens/s, "
          f"speedup {m['speedup']:.2f}x, mean accepted tokens {m['mean_accepted_tokens']:.2f}, "
          f"identical to greedy {m['exact_match_vs_greedy']:.0%}; written to {args.output}")


if __name__ == "__main__":
    main()
