"""Self-distillation's engines side by side: HF ``generate`` (the training model, length-sorted left-padded batches)
against vLLM (its own environment), the same prompts, the same dtype, through ``self_distill`` itself.

The prompts are ShareGPT first turns of at most ``--max-prompt-tokens`` tokens (the quickstart's selection), replies
greedy up to ``--max-new-tokens``. Reported per engine and dtype: new tokens per second over the whole
``self_distill`` call (vLLM's engine start excluded and reported apart), and how many replies are identical to HF's
in the same dtype.

    python benchmarks/self_distill_engines.py --num-prompts 128 --max-prompt-tokens 128 --max-new-tokens 192 \\
        --batch-size 128 --dtypes float32 bfloat16 --output self_distill_engines.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2_135m", help="a conf/model/ name")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=128, help="data.generation_batch_size")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def model_config(name: str, dtype: str) -> Any:
    from hydra import compose, initialize_config_dir

    from medusa_train.cli.app import register_shared_schemas
    from medusa_train.config.schema import ModelConfig, as_dataclass
    from medusa_train.files.paths import CONF_DIR

    register_shared_schemas()  # model/ files extend schema/model/base and use the ${medusa.*} resolvers
    with initialize_config_dir(str(CONF_DIR / "model"), version_base="1.3"):
        cfg = compose(name)
    return dataclasses.replace(as_dataclass(ModelConfig, cfg), dtype=dtype)


def first_turns(tokenizer: Any, count: int, max_prompt_tokens: int) -> list[Any]:
    """The first ``count`` ShareGPT conversations whose first turn renders to at most ``max_prompt_tokens``."""
    from medusa_train.data import load_conversations
    from medusa_train.data.self_distill import distill_prompt
    from medusa_train.chat.prompts import encode_prompt

    conversations, _ = load_conversations("sharegpt", None, count * 6, 0, require_assistant=False)
    kept = []
    for c in conversations:
        prompt = distill_prompt(c)
        if prompt and len(encode_prompt(tokenizer, prompt)) <= max_prompt_tokens and prompt not in kept:
            kept.append(prompt)
        if len(kept) == count:
            break
    return kept


def run(engine: str, dtype: str, args: argparse.Namespace, prompts: list[Any], tmp: Path) -> dict[str, Any]:
    from medusa_train.config.schema import DataConfig
    from medusa_train.data import self_distill
    from medusa_train.data.distill_engines import distill_engine, request_size
    from medusa_train.data.self_distill import read_records, written_blocks
    from medusa_train.loading.base import load_base_model

    cfg = model_config(args.model, dtype)
    model, tokenizer = load_base_model(cfg)
    data = DataConfig(self_distill_engine=engine, max_new_tokens=args.max_new_tokens,
                      generation_batch_size=args.batch_size)
    out = tmp / f"{engine}-{dtype}.jsonl"
    started = time.perf_counter()
    with distill_engine(data, model, tokenizer, cfg, args.max_prompt_tokens) as (generate, name):
        ready = time.perf_counter()
        stats = self_distill(model, tokenizer, prompts, args.max_new_tokens, request_size(data), out, generate=generate,
                             max_prompt_tokens=args.max_prompt_tokens, show_progress=False)
        wall = time.perf_counter() - ready
    records = [record for block in written_blocks(out) for record in read_records(block)]
    new_tokens = sum(r["new_tokens"] for r in records)
    print(f"{name}: {stats.generated} replies, {new_tokens} tokens in {wall:.1f} s = {new_tokens / wall:.1f} "
          f"tokens/s (engine start {ready - started:.1f} s)", flush=True)
    return {"engine": name, "dtype": dtype, "replies": stats.generated, "new_tokens": new_tokens, "wall_time_s": wall,
            "tokens_per_second": new_tokens / wall, "engine_start_s": ready - started,
            "replies_by_id": {r["id"]: r["conversations"][-1]["value"] for r in records}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from medusa_train.loading.base import load_base_model

    _, tokenizer = load_base_model(model_config(args.model, "float32"))
    prompts = first_turns(tokenizer, args.num_prompts, args.max_prompt_tokens)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="distill-engines-") as tmp:
        for dtype in args.dtypes:
            for engine in args.engines:
                runs[f"{engine}/{dtype}"] = run(engine, dtype, args, prompts, Path(tmp))
    for dtype in args.dtypes:
        hf, vllm = runs.get(f"hf/{dtype}"), runs.get(f"vllm/{dtype}")
        if hf and vllm:
            same = sum(vllm["replies_by_id"].get(k) == v for k, v in hf["replies_by_id"].items())
            vllm["same_reply_as_hf"] = same
            vllm["speedup_over_hf"] = vllm["tokens_per_second"] / hf["tokens_per_second"]
    for r in runs.values():
        r.pop("replies_by_id")
    summary = {"model": args.model, "prompts": len(prompts), "max_prompt_tokens": args.max_prompt_tokens,
               "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
               "torch_threads": torch.get_num_threads(), "runs": runs}
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print("| engine | dtype | tokens/s | vs HF, same dtype | replies identical to HF's | engine start (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs.values():
        vs = f"{r['speedup_over_hf']:.2f}x" if "speedup_over_hf" in r else "1.00x" if r["engine"].startswith("hf") \
            else "-"
        same = f"{r['same_reply_as_hf']} / {r['replies']}" if "same_reply_as_hf" in r else "-"
        print(f"| {r['engine']} | {r['dtype']} | {r['tokens_per_second']:.1f} | {vs} | {same} | "
              f"{r['engine_start_s']:.0f} |")
    return summary


if __name__ == "__main__":
    main()
