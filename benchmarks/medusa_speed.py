"""An export's trees side by side against Hugging Face ``generate`` (greedy), on ``medusa-eval``'s runner.

For each prompt, HF ``model.generate(do_sample=False)`` (the baseline) and the tree decoder with each tree asked for
(the export's tuned ``medusa_choices.json``, Medusa's ``mc_sim_7b_63`` cut to the heads, a chain of the same depth as
the tuned tree; ``--trees`` picks the last two) take turns, one untimed warm-up each first:
:func:`inference.evaluation.runner.evaluate_prompts`, the loop ``medusa-eval`` runs, so the rows, the resumption
after a kill, the speedup's 95% interval and the exact match are ``medusa-eval``'s. Beside them: the tuned tree's τ
as ``medusa-tune-tree`` predicted it from ``head_accuracy.json`` (by the independent-heads formula, and replayed on
the tuning prompts' continuations) and the measured one. ``--prompt-source sharegpt`` takes held-out ShareGPT first
turns instead, from ``--offset`` on (past the ones ``medusa-tune-tree`` measured the accuracy table on): the same
distribution as the table, so predicted and measured τ compare like for like. (``medusa-eval`` gives the tuned tree
against plain decoding; this script adds the other trees and HF ``generate`` to the same interleaved run.)

    python benchmarks/medusa_speed.py --export runs/quickstart/export --prompts 8 --max-new-tokens 96  # dtype=auto
    python benchmarks/medusa_speed.py --export runs/quickstart/export --prompt-source sharegpt --prompts 16 --trees chain

Writes ``OUT/results.jsonl`` (one row per prompt and decoder, resumed when the same command runs again),
``OUT/settings.json`` and ``OUT/medusa_speed.json`` (the table and the predicted τ); ``OUT`` is ``--output-dir``
(default ``EXPORT/medusa_speed``). A folder holding rows of other settings is refused, naming the setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference.decoders import DecodeConfig, TreeDecoder  # noqa: E402
from inference.decoders.base import DecodeResult  # noqa: E402
from inference.decoders.choices import resolve_medusa_choices  # noqa: E402
from inference.decoders.hf_peers import hf_generate  # noqa: E402
from inference.decoders.tree import default_medusa_choices  # noqa: E402
from inference.evaluation.eval_config import EvaluateConfig  # noqa: E402
from inference.evaluation.eval_run import load_eval_prompts  # noqa: E402
from inference.evaluation.runner import evaluate_prompts  # noqa: E402
from inference.evaluation.summary import markdown_table, summarize  # noqa: E402
from inference.tuning.replay import replayed_accept_length  # noqa: E402
from inference.tuning.search import expected_accept_length  # noqa: E402
from medusa_train.chat.prompts import SHAREGPT_HELDOUT_OFFSET  # noqa: E402
from medusa_train.export.tree_files import read_tree_files  # noqa: E402
from medusa_train.files.atomic import atomic_write_text  # noqa: E402
from medusa_train.loading.runtime import load_for_inference  # noqa: E402
from medusa_train.tree.buffers import chain_choices  # noqa: E402
from runner_folder import open_log  # noqa: E402

BASELINE = "hf_generate"


class HfGenerate:
    """HF ``generate(do_sample=False)`` of the export's base model behind the decoders' interface (the baseline)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def generate(self, input_ids: list[int], config: DecodeConfig, streamer: Any = None) -> DecodeResult:
        return hf_generate(self.model.base, input_ids, config, streamer, self.tokenizer, BASELINE)


def predicted_tau(export: Path, tree: list[list[int]]) -> dict[str, float]:
    """The tuned tree's τ predicted from ``head_accuracy.json`` (empty without one): ``formula`` (independent heads)
    and ``replayed`` (greedy verification replayed on the tuning prompts' continuations, when recorded)."""
    table = read_tree_files(export).get("head_accuracy")
    if not table:
        return {}
    out = {"formula": expected_accept_length(table["acc"], tree)}
    if table.get("target_ranks"):
        out["replayed"] = replayed_accept_length(table["target_ranks"], tree)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", required=True)
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the hardware has bf16 units), float32, ...")
    parser.add_argument("--cpu-kernels", default="auto", choices=("auto", "packed", "none"))
    parser.add_argument("--prompts", type=int, default=8,
                        help="MT-Bench first turns: the first ceil(N/8) of each of its 8 categories, then the first "
                             "N (medusa-eval's per_category); ShareGPT: N from --offset")
    parser.add_argument("--prompt-source", choices=("mt_bench", "sharegpt"), default="mt_bench")
    parser.add_argument("--offset", type=int, default=SHAREGPT_HELDOUT_OFFSET + 100,
                        help="first held-out ShareGPT conversation (--prompt-source sharegpt)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--trees", nargs="*", choices=("mc_sim_7b_63", "chain"), default=["mc_sim_7b_63", "chain"],
                        help="trees decoded beside the tuned one")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--output-dir", default=None, help="the run's folder (default EXPORT/medusa_speed)")
    args = parser.parse_args()
    for flag in ("prompts", "max_new_tokens", "topk"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a number >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    source = {"prompts": args.prompt_source, "num_prompts": args.prompts, "output_dir": "unused"}
    if args.prompt_source == "sharegpt":
        source["prompt_offset"] = args.offset
    else:
        source["per_category"] = -(-args.prompts // 8)  # one of each of MT-Bench's 8 categories first
    prompts = load_eval_prompts(EvaluateConfig(**source))
    out = Path(args.output_dir or Path(args.export) / "medusa_speed")
    settings = {k: v for k, v in vars(args).items() if k not in ("output_dir", "threads")}
    results = open_log(out, settings)

    model, tokenizer, _, runtime = load_for_inference(args.export, dtype=args.dtype, cpu_kernels=args.cpu_kernels)
    heads = model.heads.spec.num_heads
    tuned = resolve_medusa_choices(None, args.export, heads, args.topk)
    trees = {"tuned": tuned, "mc_sim_7b_63": default_medusa_choices(heads, args.topk),
             "chain": chain_choices(max(len(p) for p in tuned))}
    trees = {name: trees[name] for name in ["tuned", *args.trees]}
    decoders = {BASELINE: HfGenerate(model, tokenizer),
                **{f"tree[{name}]": TreeDecoder(model, tree, topk=args.topk, acceptance="greedy")
                   for name, tree in trees.items()}}
    eos = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    request = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    run = evaluate_prompts(decoders, tokenizer, prompts, request, results, baseline=BASELINE, max_turns=1)
    summary = summarize(run.rows, greedy=True, model=args.export, device=str(model.lm_head.weight.device),
                        dtype=runtime.dtype.name, max_new_tokens=args.max_new_tokens, baseline=BASELINE,
                        runtime=runtime.record())
    for name, tree in trees.items():
        summary["decoders"][f"tree[{name}]"]["nodes"] = len(tree) + 1
    predicted = predicted_tau(Path(args.export), tuned)
    summary.update(prompt_source=args.prompt_source, offset=args.offset if args.prompt_source == "sharegpt" else None,
                   threads=torch.get_num_threads(), predicted_tau_tuned=predicted)
    atomic_write_text(out / "medusa_speed.json", json.dumps(summary, indent=1))

    print(f"{summary['prompts']} {args.prompt_source} prompts x {args.max_new_tokens} tokens, {runtime.dtype.name}, "
          f"{torch.get_num_threads()} threads; tree sizes: "
          + ", ".join(f"{name} {len(tree) + 1} nodes" for name, tree in trees.items()))
    if predicted:
        measured = summary["decoders"]["tree[tuned]"]["mean_accepted_tokens"]
        print("predicted tau of the tuned tree (from the tuning prompts) against the measured "
              f"{measured:.3f}: " + ", ".join(f"{k} {v:.3f} ({(v - measured) / measured:+.1%})"
                                              for k, v in predicted.items()))
    print(markdown_table(summary["decoders"]))
    print(f"wrote {out / 'medusa_speed.json'}")


if __name__ == "__main__":
    main()
