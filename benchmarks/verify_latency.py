"""The verification latency curve t(k)/t(1) of a target, in our decoder and in llama.cpp, and a draft model's cost per
drafted token against the target's: what bounds every speedup of speculative decoding on this machine.

    python benchmarks/verify_latency.py --model qwen2_5_coder_1_5b --draft qwen2_5_coder_0_5b \\
        --output docs/coder-1.5b-latency.json

- **ours**: one forward pass of the target over k new tokens after ``--context`` cached ones, with the tree decoder's
  4-D mask and the lm_head over the k positions (:func:`inference.tuning.latency.measure_verification_latency`, what
  ``medusa-tune-tree`` measures), in ``--dtype`` (``auto``: bf16 where the CPU multiplies bf16) on the kernels
  ``cpu_kernels=auto`` chooses; fastest of ``--repeats``, the sizes taking turns. The draft's t(1) the same way.
- **llama.cpp**: ``llama-bench -p K -n 0 -d CONTEXT`` (a batch of k prompt tokens after ``CONTEXT`` cached ones) on
  the model's GGUF as stored, ``--repack`` as our llama-server rows run it, ``-t`` threads; the mean of
  ``--repeats`` runs. The draft GGUF's t(1) the same way.

Run it alone: nothing else may compute on the machine meanwhile. Writes ``--output`` (JSON: per engine
``{"t_ms": {k: ms}, "ratio": {k: t(k)/t(1)}, "draft_t1_ms", "draft_cost"}`` with the CPU and date) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def model_config(preset: str) -> Any:
    """The ``model/`` preset ``preset`` as a :class:`~medusa_train.config.schema.ModelConfig` (resolvers run: an uninstalled
    model fails here with its install command)."""
    from hydra import compose, initialize_config_dir

    from medusa_train.config.schema import ModelConfig, as_dataclass
    from medusa_train.files.paths import CONF_DIR
    from medusa_train.cli.app import register_shared_schemas

    register_shared_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return as_dataclass(ModelConfig, compose(f"model/{preset}").model)


def ours(preset: str, draft: str | None, dtype: str, context: int, sizes: list[int], repeats: int) -> dict[str, Any]:
    """t(k) of the target in our decoder's pass, and the draft's t(1)."""
    from inference.tuning.latency import measure_verification_latency
    from medusa_train.loading.runtime import load_target_for_inference

    record: dict[str, Any] = {}
    model, _, runtime = load_target_for_inference(model_config(preset), dtype=dtype, echo=None)
    profile = measure_verification_latency(model.base, sizes, context, repeats)
    record["t_ms"] = {int(k): v for k, v in profile["latency_ms"].items()}
    record["dtype"], record["kernels"] = runtime.dtype.name, runtime.kernels.kernels
    del model
    if draft is not None:
        drafted, _, _ = load_target_for_inference(model_config(draft), dtype=dtype, echo=None)
        record["draft_t1_ms"] = measure_verification_latency(drafted.base, [1], context, repeats)["latency_ms"][1]
    return record


def llamacpp(preset: str, draft: str | None, context: int, sizes: list[int], repeats: int, threads: int) -> dict:
    """t(k) of the target's GGUF in ``llama-bench``, and the draft GGUF's t(1)."""
    from medusa_train.engines.llamacpp_env import REPACK
    from medusa_train.engines.llamacpp_env import llamacpp_binary
    from medusa_train.loading.conversion_cache import gguf_location

    def bench(gguf: str, ks: list[int]) -> dict[int, float]:
        command = [str(llamacpp_binary("llama-bench")), "-m", gguf, "-p", ",".join(map(str, ks)), "-n", "0",
                   "-d", str(context), "-t", str(threads), "-r", str(repeats), "--repack", str(int(REPACK)),
                   "-o", "json"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in json.loads(done.stdout)}

    def gguf(name: str) -> str:
        folder, file = gguf_location(model_config(name))
        return str(folder / file)

    record: dict[str, Any] = {"t_ms": bench(gguf(preset), sizes), "repack": REPACK, "threads": threads}
    if draft is not None:
        record["draft_t1_ms"] = bench(gguf(draft), [1])[1]
    return record


def main(argv: list[str] | None = None) -> int:
    from data_scaling import cpu_model, git
    from medusa_train.files.atomic import atomic_write_text
    from medusa_train.config.precision import cpu_flags

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2_5_coder_1_5b", help="the target's model/ preset")
    parser.add_argument("--draft", default="qwen2_5_coder_0_5b", help="a draft's model/ preset ('' for none)")
    parser.add_argument("--engines", nargs="+", default=["ours", "llamacpp"], choices=["ours", "llamacpp"])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="k, new tokens per pass")
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto", help="ours: auto, bfloat16 or float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch and llama.cpp threads")
    parser.add_argument("--output", help="write the JSON here")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or 1 not in args.sizes:
        parser.error("--sizes: every k >= 1, and 1 among them (the curve is t(k)/t(1))")
    if args.repeats < 1 or args.context < 1 or args.threads < 1:
        parser.error("--repeats, --context and --threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    sizes, draft = sorted(set(args.sizes)), args.draft or None
    result: dict[str, Any] = {"model": args.model, "draft": draft, "context": args.context,
                              "cpu": {"model": cpu_model(), "flags": sorted(cpu_flags() & {
                                  "avx2", "avx512f", "avx512_bf16", "amx_bf16"}), "cores": os.cpu_count()},
                              "load_average_before": os.getloadavg()[0],
                              "date": datetime.now(timezone.utc).date().isoformat(),
                              "commit": git("rev-parse", "--short", "HEAD"), "engines": {}}
    for engine in args.engines:
        record = ours(args.model, draft, args.dtype, args.context, sizes, args.repeats) if engine == "ours" else \
            llamacpp(args.model, draft, args.context, sizes, args.repeats, args.threads)
        t1 = record["t_ms"][1]
        record["ratio"] = {k: v / t1 for k, v in record["t_ms"].items()}
        if "draft_t1_ms" in record:
            record["draft_cost"] = record["draft_t1_ms"] / t1  # c: a drafted token's cost in target tokens
        result["engines"][engine] = record
        print(f"{engine}: t(1) {t1:.1f} ms; " + ", ".join(f"k={k} {r:.2f}" for k, r in record["ratio"].items())
              + (f"; draft t(1) {record['draft_t1_ms']:.1f} ms = {record['draft_cost']:.2f} of the target's"
                 if "draft_cost" in record else ""), flush=True)
    result["load_average_after"] = os.getloadavg()[0]
    if args.output:
        atomic_write_text(Path(args.output), json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
