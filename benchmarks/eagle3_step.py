"""One EAGLE-3 training step (the training-time test's forward + backward and its chunked loss), variants side by side.

A random fp32 drafter at a target's shapes (default SmolLM2-135M: H=576, 9 heads, 3 kv heads, head_dim 64,
intermediate 1536) over random target features, with a draft vocabulary of V' tokens, K unrolled steps, B sequences of
T tokens whose first ``--prompt-fraction`` carry no loss (prompts). Variants, alternated on the same batch
(``--repeats`` rounds, one step of each per round, after one warm-up round; the table gives each variant's median and
its ratio to the first variant's, in wall time and in this process's CPU time, the second less disturbed by other
processes on shared cores):

- ``full``: every step of the unroll at all T positions, the features then read at the loss positions (what the
  training-time test computed before the compact unroll);
- ``compact``: :meth:`medusa_train.drafters.eagle3.drafter.Eagle3Drafter.unroll` with ``at`` (step 0's keys/values
  at all T, the rest at the loss positions only), what ``medusa-train`` runs;
- ``compact_bf16``: ``compact`` under ``torch.autocast("cpu", torch.bfloat16)`` (what the HF Trainer does with
  ``trainer.precision=bf16`` on a CPU), fp32 weights.

    python benchmarks/eagle3_step.py                                   # SmolLM2-135M's shapes, B=8, T=320, K=5
    python benchmarks/eagle3_step.py --variants full,compact --repeats 9 --threads 2

Writes ``OUTPUT_DIR/eagle3_step.json`` (the load average before and after is recorded beside the times).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from medusa_train.drafters.eagle3.drafter import Eagle3Drafter, Eagle3Spec
from medusa_train.config.precision import cpu_isa
from medusa_train.training.losses import head_targets, projected_head_loss
from medusa_train.training.step import counted_positions

VARIANTS = ("full", "compact", "compact_bf16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--vocab-size", type=int, default=49152, help="the target's V")
    parser.add_argument("--draft-vocab", type=int, default=4096, help="V'")
    parser.add_argument("--steps", type=int, default=5, help="K, the unrolled draft steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--prompt-fraction", type=float, default=0.4, help="leading share of each sequence unlabelled")
    parser.add_argument("--loss-chunk-size", type=int, default=2048)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/eagle3_step"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    torch.manual_seed(0)
    H, B, T, K = args.hidden_size, args.batch_size, args.length, args.steps
    spec = Eagle3Spec(num_heads=K, num_layers=1, hidden_size=H, vocab_size=args.vocab_size,
                      head_vocab_size=args.draft_vocab, feature_layers=(2, 15, 27), num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      intermediate_size=args.intermediate_size)
    token_map = torch.randperm(args.vocab_size)[: args.draft_vocab].sort().values
    heads = Eagle3Drafter(spec, token_map)
    taps = [torch.randn(B, T, H) for _ in spec.feature_layers]
    path_embeds = torch.randn(B, T, K, H)
    labels = token_map[torch.randint(args.draft_vocab, (B, T))]
    labels[:, : int(args.prompt_fraction * T)] = -100
    at = counted_positions(labels, K)
    targets = head_targets(labels, K, target="labels")[:, at[0], at[1]]  # [K, M]
    normalizer = float((labels != -100).sum())

    def loss_fn(features: torch.Tensor, weight: torch.Tensor):
        return projected_head_loss(features, weight, targets, decay=0.8, normalizer=normalizer,
                                   chunk_size=args.loss_chunk_size, token_map=token_map,
                                   vocab_size=args.vocab_size)

    def step(variant: str) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of one forward + backward."""
        heads.zero_grad(set_to_none=True)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if variant.endswith("bf16")
                    else contextlib.nullcontext())
        start, cpu_start = time.perf_counter(), time.process_time()
        with autocast:
            if variant == "full":
                out = heads.unroll(taps, path_embeds, None, K, None,
                                   lambda features, weight: loss_fn(features[:, at[0], at[1]], weight))
            else:
                out = heads.unroll(taps, path_embeds, None, K, at, loss_fn)
        out.loss.backward()
        return time.perf_counter() - start, time.process_time() - cpu_start

    load_before = os.getloadavg()
    for variant in variants:  # warm-up round
        step(variant)
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu_times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            wall, cpu = step(variant)
            times[variant].append(wall)
            cpu_times[variant].append(cpu)
    load_after = os.getloadavg()
    first = variants[0]
    medians = {v: statistics.median(ts) for v, ts in times.items()}
    cpu_medians = {v: statistics.median(ts) for v, ts in cpu_times.items()}
    # per round: each variant over the first one measured just before it (robust to the load drifting)
    round_ratios = {v: statistics.median(a / b for a, b in zip(times[v], times[first])) for v in variants}
    cpu_round_ratios = {v: statistics.median(a / b for a, b in zip(cpu_times[v], cpu_times[first]))
                        for v in variants}
    result = {
        "shapes": {"B": B, "T": T, "K": K, "H": H, "draft_vocab": args.draft_vocab, "heads": args.heads,
                   "kv_heads": args.kv_heads, "head_dim": args.head_dim, "intermediate": args.intermediate_size,
                   "loss_positions": int(at[0].numel()), "labelled": int(normalizer)},
        "threads": torch.get_num_threads(), "cpu": cpu_isa(), "load_before": load_before, "load_after": load_after,
        "repeats": args.repeats, "seconds": times, "cpu_seconds": cpu_times, "median_s": medians,
        "median_cpu_s": cpu_medians,
        "ratio_to_" + first: {v: medians[v] / medians[first] for v in variants},
        "cpu_ratio_to_" + first: {v: cpu_medians[v] / cpu_medians[first] for v in variants},
        "median_round_ratio_to_" + first: round_ratios,
        "median_cpu_round_ratio_to_" + first: cpu_round_ratios,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "eagle3_step.json").write_text(json.dumps(result, indent=2))
    print(f"B={B} T={T} K={K} V'={args.draft_vocab}: {result['shapes']['loss_positions']} of {B * T} positions carry "
          f"loss; threads {result['threads']}; load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    for v in variants:
        print(f"  {v:>13}: median {medians[v] * 1000:8.1f} ms wall, {cpu_medians[v] * 1000:8.1f} ms CPU  "
              f"({medians[v] / medians[first]:.3f} x {first} wall, {cpu_medians[v] / cpu_medians[first]:.3f} CPU, "
              f"per round {round_ratios[v]:.3f} wall, {cpu_round_ratios[v]:.3f} CPU)")

if __name__ == "__main__":
    main()
