"""Medusa-2 against Medusa-1 on the same prompts: mean accepted tokens, and how far the fine-tuned base drifted.

Loads two exports: a Medusa-1 export (heads on the original base) and a Medusa-2 export (heads plus the fine-tuned
base in ``export/base``). On held-out ShareGPT first turns (by default past the prompts ``medusa-tune-tree`` measures
on) it reports, in one run:

- mean accepted tokens (τ) of greedy tree decoding with each export's own tree and, to compare the heads rather than
  the trees, with Medusa's ``mc_sim_7b_63`` tree for both (Medusa-2's is measured on its own, fine-tuned base, whose
  greedy output it reproduces exactly). The four decoders take turns per prompt on ``medusa-eval``'s runner
  (:func:`inference.evaluation.runner.evaluate_prompts`), Medusa-1 with its own tree first: its reply is the
  original model's greedy reply (greedy verification is lossless), so the exact-match column of Medusa-2's rows is
  the share of replies the fine-tuned base left unchanged;
- greedy agreement: the share of the original model's greedy tokens that the fine-tuned base also predicts, teacher
  forced on the original's reply (1.0: the fine-tuned model says what the original says; issue target >= 0.9);
- the perplexity of each base on held-out ShareGPT assistant turns (the original human-written text), and its change.

    python benchmarks/medusa2_vs_medusa1.py --medusa1 runs/quickstart/export --medusa2 runs/medusa2/export \
        --prompts 8 --max-new-tokens 96

Writes ``OUT/results.jsonl`` (the decoders' rows, resumed when the same command runs again), ``OUT/settings.json``
and ``OUT/medusa2_vs_medusa1.json``; ``OUT`` is ``--output-dir`` (default ``MEDUSA2/medusa2_vs_medusa1``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from inference.decoders import DecodeConfig, TreeDecoder  # noqa: E402
from inference.decoders.choices import resolve_medusa_choices  # noqa: E402
from inference.decoders.tree import default_medusa_choices  # noqa: E402
from inference.evaluation.runner import evaluate_prompts  # noqa: E402
from inference.evaluation.summary import summarize  # noqa: E402
from medusa_train.chat.prompts import SHAREGPT_HELDOUT_OFFSET, encode_prompt, sharegpt_prompts  # noqa: E402
from medusa_train.data import build_dataset, load_conversations  # noqa: E402
from medusa_train.files.atomic import atomic_write_text  # noqa: E402
from medusa_train.loading.export import load_export  # noqa: E402
from runner_folder import open_log  # noqa: E402

TREES = ("own tree", "mc_sim_7b_63")


@torch.inference_mode()
def agreement(model: Any, prompt: list[int], reply: list[int]) -> tuple[int, int]:
    """``(matches, positions)``: positions of ``reply`` where ``model``'s argmax, fed ``prompt + reply``, is the reply's
    token (teacher forcing on the reply)."""
    if not reply:
        return 0, 0
    ids = torch.tensor([prompt + reply], device=model.lm_head.weight.device)
    logits = model.base(ids).logits[0, len(prompt) - 1 : -1]  # [len(reply), V]: predictions of each reply token
    return int((logits.argmax(-1).cpu() == torch.tensor(reply)).sum()), len(reply)


@torch.inference_mode()
def assistant_nll(model: Any, rows: Any) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of the labelled (assistant) tokens of ``rows`` and their count."""
    total, count = 0.0, 0
    device = model.lm_head.weight.device
    for row in rows:
        ids = torch.tensor([row["input_ids"]], device=device)
        labels = torch.tensor(row["labels"], device=device)[1:]
        logp = torch.log_softmax(model.base(ids).logits[0, :-1].float(), dim=-1)
        keep = labels != -100
        total += float(-logp[keep].gather(-1, labels[keep, None]).sum())
        count += int(keep.sum())
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--medusa1", required=True, help="Medusa-1 export (the original base)")
    parser.add_argument("--medusa2", required=True, help="Medusa-2 export (heads + export/base)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8, help="held-out ShareGPT first turns")
    parser.add_argument("--offset", type=int, default=SHAREGPT_HELDOUT_OFFSET + 100,
                        help="first ShareGPT conversation used (tune-tree uses those from 16000)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--ppl-conversations", type=int, default=16, help="held-out conversations for perplexity")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per perplexity conversation")
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--output-dir", default=None, help="the run's folder (default MEDUSA2/medusa2_vs_medusa1)")
    args = parser.parse_args()
    for flag in ("prompts", "max_new_tokens", "topk", "ppl_conversations", "max_length"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a number >= 1")
    out = Path(args.output_dir or Path(args.medusa2) / "medusa2_vs_medusa1")
    results = open_log(out, {k: v for k, v in vars(args).items() if k != "output_dir"})

    models, decoders = {}, {}
    tokenizer = None
    for name, export in (("medusa1", args.medusa1), ("medusa2", args.medusa2)):
        model, tokenizer, _ = load_export(export, dtype=args.dtype)
        models[name] = model
        own = resolve_medusa_choices(None, export, model.heads.spec.num_heads, args.topk)
        same = default_medusa_choices(model.heads.spec.num_heads, args.topk)
        for tree_name, tree in zip(TREES, (own, same)):
            decoders[f"{name}[{tree_name}]"] = TreeDecoder(model, tree, topk=args.topk, acceptance="greedy")
    original = f"medusa1[{TREES[0]}]"  # the original model's greedy reply (greedy verification is lossless)
    eos = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    request = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    prompts = sharegpt_prompts(args.offset, args.prompts)
    run = evaluate_prompts(decoders, tokenizer, prompts, request, results, baseline=original, max_turns=1)
    summary = summarize(run.rows, greedy=True, model=args.medusa2, device=str(model.lm_head.weight.device),
                        dtype=args.dtype, max_new_tokens=args.max_new_tokens, baseline=original)

    by_id = {p.id: p for p in prompts}
    matches = positions = 0
    for row in run.rows:
        if row["decoder"] == original:
            ids = encode_prompt(tokenizer, by_id[row["prompt_id"]].first_turn_messages())
            m, n = agreement(models["medusa2"], ids, list(row["tokens"]))
            matches, positions = matches + m, positions + n

    start = args.offset + args.prompts  # perplexity text: other held-out conversations
    conversations, _ = load_conversations("sharegpt", max_conversations=start + args.ppl_conversations)
    rows, _, _ = build_dataset(tokenizer, conversations[start:], args.max_length, 0.0, seed=0)
    ppl = {}
    for name, model in models.items():
        nll, count = assistant_nll(model, rows)
        ppl[name] = math.exp(nll / max(count, 1))

    metrics = summary["decoders"]
    tau = {name: m["mean_accepted_tokens"] for name, m in metrics.items()}
    report = {"dtype": args.dtype, "prompts": summary["prompts"], "offset": args.offset,
              "max_new_tokens": args.max_new_tokens, "mean_accepted_tokens": tau,
              "replies_unchanged": {name: m["exact_match_vs_greedy"] for name, m in metrics.items()},
              "greedy_agreement": matches / max(positions, 1), "agreement_positions": positions,
              "perplexity": ppl, "perplexity_change": ppl["medusa2"] / ppl["medusa1"] - 1.0,
              "perplexity_tokens": count}
    print(f"{summary['prompts']} held-out ShareGPT prompts x {args.max_new_tokens} tokens, {args.dtype}")
    print("| export | τ, own tree | τ, mc_sim_7b_63 | replies equal to Medusa-1's | perplexity (held-out ShareGPT replies) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in models:
        own = metrics[f"{name}[{TREES[0]}]"]
        taus = [tau[f"{name}[{tree}]"] for tree in TREES]  # None: every reply ended at its first token
        print(f"| {name} | " + " | ".join("n/a" if t is None else f"{t:.3f}" for t in taus) +
              f" | {own['exact_match_vs_greedy']:.2f} | {ppl[name]:.2f} |")
    print(f"greedy agreement of the fine-tuned base with the original: {report['greedy_agreement']:.3f} "
          f"({positions} tokens); perplexity change {100 * report['perplexity_change']:+.1f}%")
    atomic_write_text(out / "medusa2_vs_medusa1.json", json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
