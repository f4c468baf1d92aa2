"""Medusa decoding against Hugging Face ``generate`` (greedy), same prompts, same run, interleaved.

For each MT-Bench first turn: HF ``model.generate(do_sample=False)``, then the Medusa decoder with each tree asked
for (the export's tuned ``medusa_choices.json``, Medusa's ``mc_sim_7b_63`` cut to the heads, a chain of the same
depth as the tuned tree; ``--trees`` picks the last two), in turn, so the machine's drift hits all alike; one
untimed warm-up first. Prints and writes tokens/s, the ratio to HF generate, mean accepted tokens (τ) and exact match
against HF's tokens, and the tuned tree's τ as ``medusa-tune-tree`` predicted it from ``head_accuracy.json`` (by the
independent-heads formula, and replayed on the tuning prompts' continuations) beside the measured one.
``--prompt-source sharegpt`` takes held-out ShareGPT first turns instead, from ``--offset`` on (past the ones
``medusa-tune-tree`` measured the accuracy table on): the same distribution as the table, so predicted and measured
τ compare like for like.

    python benchmarks/medusa_speed.py --export runs/quickstart/export --prompts 8 --max-new-tokens 96  # dtype=auto
    python benchmarks/medusa_speed.py --export runs/quickstart/export --prompt-source sharegpt --prompts 16 --trees chain
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from inference.decoders import DecodeConfig, TreeDecoder
from inference.decoders.choices import resolve_medusa_choices
from inference.decoders.tree import default_medusa_choices
from inference.tuning.replay import replayed_accept_length
from inference.tuning.search import expected_accept_length
from medusa_train.export.tree_files import read_tree_files
from medusa_train.loading.runtime import load_for_inference
from medusa_train.chat.prompts import SHAREGPT_HELDOUT_OFFSET, encode_prompt, load_prompts, sharegpt_prompts
from medusa_train.tree.buffers import chain_choices


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
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns, one per category first")
    parser.add_argument("--prompt-source", choices=("mt_bench", "sharegpt"), default="mt_bench")
    parser.add_argument("--offset", type=int, default=SHAREGPT_HELDOUT_OFFSET + 100,
                        help="first held-out ShareGPT conversation (--prompt-source sharegpt)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--trees", nargs="*", choices=("mc_sim_7b_63", "chain"), default=["mc_sim_7b_63", "chain"],
                        help="trees decoded beside the tuned one")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--output", default=None, help="JSON file for the figures (default EXPORT/medusa_speed.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer, _, runtime = load_for_inference(args.export, dtype=args.dtype, cpu_kernels=args.cpu_kernels)
    heads = model.heads.spec.num_heads
    tuned = resolve_medusa_choices(None, args.export, heads, args.topk)
    trees = {"tuned": tuned, "mc_sim_7b_63": default_medusa_choices(heads, args.topk),
             "chain": chain_choices(max(len(p) for p in tuned))}
    trees = {name: trees[name] for name in ["tuned", *[t for t in args.trees if t != "tuned"]]}
    decoders = {name: TreeDecoder(model, tree, topk=args.topk, acceptance="greedy") for name, tree in trees.items()}
    if args.prompt_source == "sharegpt":
        ordered = sharegpt_prompts(args.offset, args.prompts)
    else:
        by_category: dict[str, list] = {}
        for p in load_prompts("mt_bench"):
            by_category.setdefault(p.category, []).append(p)
        ordered = [p for group in zip(*by_category.values()) for p in group][: args.prompts]
    eos = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)

    def hf_generate(ids: list[int]) -> tuple[list[int], float]:
        x = torch.tensor([ids], device=model.lm_head.weight.device)
        start = time.perf_counter()
        out = model.base.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0] if eos else 0)
        return out[0, x.shape[1]:].tolist(), time.perf_counter() - start

    warm = encode_prompt(tokenizer, [{"role": "user", "content": "Hello"}])
    hf_generate(warm)
    for d in decoders.values():
        d.generate(warm, DecodeConfig(max_new_tokens=8))
    totals = {name: {"tokens": 0, "time": 0.0, "passes": 0, "decoded": 0, "match": 0} for name in ["hf", *decoders]}
    for prompt in ordered:
        ids = encode_prompt(tokenizer, prompt.first_turn_messages())
        ref, dt = hf_generate(ids)
        totals["hf"]["tokens"] += len(ref)
        totals["hf"]["time"] += dt
        for name, decoder in decoders.items():
            result = decoder.generate(ids, config)
            t = totals[name]
            t["tokens"] += len(result.tokens)
            t["time"] += result.wall_time_s
            t["passes"] += result.forward_passes
            t["decoded"] += sum(result.accepted_lengths)
            t["match"] += int(result.tokens == ref)
    hf_rate = totals["hf"]["tokens"] / totals["hf"]["time"]
    predicted = predicted_tau(Path(args.export), tuned)
    rows = {"hf_generate": {"tokens_per_second": hf_rate, "speedup": 1.0, "mean_accepted_tokens": 1.0,
                            "exact_match": 1.0, "nodes": 1}}
    for name, tree in trees.items():
        t = totals[name]
        rows[f"medusa[{name}]"] = {"tokens_per_second": t["tokens"] / t["time"],
                                   "speedup": t["tokens"] / t["time"] / hf_rate,
                                   "mean_accepted_tokens": t["decoded"] / max(t["passes"], 1),
                                   "exact_match": t["match"] / len(ordered), "nodes": len(tree) + 1}
    source = "MT-Bench" if args.prompt_source == "mt_bench" else f"held-out ShareGPT (from {args.offset})"
    print(f"{len(ordered)} {source} prompts x {args.max_new_tokens} tokens, {runtime.dtype.name}, "
          f"{torch.get_num_threads()} threads")
    if predicted:
        measured = rows["medusa[tuned]"]["mean_accepted_tokens"]
        print("predicted tau of the tuned tree (from the tuning prompts) against the measured "
              f"{measured:.3f}: " + ", ".join(f"{k} {v:.3f} ({(v - measured) / measured:+.1%})"
                                              for k, v in predicted.items()))
    print("| decoder | tree tokens | tokens/s | speedup vs HF generate | mean accepted tokens | exact match |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['nodes']} | {r['tokens_per_second']:.2f} | {r['speedup']:.2f} | "
              f"{r['mean_accepted_tokens']:.2f} | {r['exact_match']:.2f} |")
    out = Path(args.output or Path(args.export) / "medusa_speed.json")
    out.write_text(json.dumps({"dtype": runtime.dtype.name, **runtime.record(), "prompt_source": args.prompt_source,
                               "prompts": len(ordered), "max_new_tokens": args.max_new_tokens,
                               "offset": args.offset if args.prompt_source == "sharegpt" else None,
                               "predicted_tau_tuned": predicted, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
