"""Peak memory of one heads' training step (forward + backward) at a 128k vocabulary, chunked loss or not.

Each configuration runs in a fresh subprocess (``--child``) that builds the drafter (K heads, hidden size H, the
vocabulary V of Llama 3.1), one sequence of T labelled tokens as the hidden-state cache gives them, and runs
:func:`medusa_train.training.step.heads_on_batch` forward and backward once. It reports its peak resident set size
(``ru_maxrss``), its resident size just before the step, and their difference: what the step itself needed. The
loss either holds the heads' logits ``[K, M, V]`` at once (``trainer.loss_chunk_size=0``) or projects
``--chunk`` rows at a time (:mod:`medusa_train.training.chunked_loss`).

Logits held at once need several ``K x T x V`` float32 blocks (5.25 GB each at K=5, T=2048), so the unchunked path
runs only where its estimate (from the smallest T measured) fits in 80% of the memory available; the others are
recorded as skipped with that estimate. Each child's address space is capped there too, so that a wrong estimate
fails the child instead of the machine.

    python benchmarks/loss_memory.py                                   # Medusa K=5 and EAGLE-3, H=256, T=256..2048
    python benchmarks/loss_memory.py --drafters medusa --seq 512 2048 --hidden 512 --target soft

The last line printed is the JSON summary (also written to ``--output`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

LLAMA3_VOCAB = 128_256


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def child(args: argparse.Namespace) -> dict:
    """One step in this process; returns the figures (bytes)."""
    import torch

    from medusa_train.models.catalog import heads_from_spec, new_spec
    from medusa_train.models.features import FINAL
    from medusa_train.training.step import FrozenBase, LossSpec, feature_key, heads_on_batch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    V, H, K, T = args.vocab, args.hidden, args.heads, args.seq[0]
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    embed = torch.nn.Embedding(V, H).requires_grad_(False)
    sizes = dict(num_heads=K, num_layers=1, hidden_size=H, vocab_size=V)
    if args.drafter == "eagle3":
        target = type("Target", (), dict(num_hidden_layers=8, hidden_size=H, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, intermediate_size=2 * H))()
        spec = new_spec("eagle3", {"feature_layers": (2, 4, 5)}, target, **sizes)
    else:
        spec = new_spec(args.drafter, {}, None, **sizes)
    heads = heads_from_spec(spec)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    from medusa_train.models.catalog import type_of

    names = type_of(heads).feature_names(spec)
    input_ids = torch.randint(0, V, (1, T))
    batch = {feature_key(n): torch.randn(1, T, H) for n in {FINAL, *names}}
    batch.update(labels=input_ids.clone(), input_ids=input_ids, attention_mask=torch.ones(1, T, dtype=torch.long))
    base = FrozenBase(backbone=None, lm_head=lm_head, embed=embed)
    with torch.no_grad():
        batch["base_argmax"] = base.argmax(batch["hidden"], 256)
    loss_spec = LossSpec(target=args.target, decay=0.8, share_lm_head=False, vocab_size=V, num_heads=K,
                         head_type=spec.head_type, features=names, loss_chunk_size=args.chunk)
    before = rss_bytes()
    out = heads_on_batch(heads, base, batch, loss_spec)
    out.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = int(out.count.sum())
    return {"drafter": args.drafter, "chunk": args.chunk, "seq": T, "rows": rows, "loss": round(float(out.loss), 6),
            "rss_before_step": before, "peak_rss": peak, "step_bytes": peak - before,
            "logits_bytes_at_once": rows * V * 4}


def run_child(args: argparse.Namespace, drafter: str, chunk: int, seq: int, cap: int) -> dict:
    command = [sys.executable, __file__, "--child", "--drafter", drafter, "--chunk", str(chunk), "--seq", str(seq),
               "--hidden", str(args.hidden), "--heads", str(args.heads), "--vocab", str(args.vocab),
               "--target", args.target, "--threads", str(args.threads)]
    env = {**os.environ, "LOSS_MEMORY_CAP": str(cap)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"drafter": drafter, "chunk": chunk, "seq": seq, "failed": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", nargs="+", default=["medusa", "eagle3"], choices=["medusa", "hydra", "eagle3"])
    parser.add_argument("--seq", nargs="+", type=int, default=[256, 512, 2048], help="tokens T (all labelled)")
    parser.add_argument("--chunk", type=int, default=2048, help="trainer.loss_chunk_size of the chunked runs")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=5, help="K heads (EAGLE-3: training-time test steps)")
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB)
    parser.add_argument("--target", default="labels", choices=["labels", "base_argmax", "soft"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--drafter", default="medusa", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("hidden", "heads", "vocab", "threads", *(() if args.child else ("chunk",))):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.child:
        cap = int(os.environ.get("LOSS_MEMORY_CAP", "0"))
        if cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        print(json.dumps(child(args)))
        return

    cap = int(0.8 * available_bytes())
    results = []
    for drafter in args.drafters:
        slope = None  # unchunked step bytes per labelled row, from the smallest T measured
        for seq in sorted(args.seq):
            results.append(run_child(args, drafter, args.chunk, seq, cap))
            estimate = None if slope is None else int(slope * args.heads * seq)
            if estimate is not None and estimate > cap:
                results.append({"drafter": drafter, "chunk": 0, "seq": seq, "skipped": True,
                                "estimated_step_bytes": estimate, "cap_bytes": cap})
                continue
            r = run_child(args, drafter, 0, seq, cap)
            results.append(r)
            if slope is None and "step_bytes" in r:
                slope = r["step_bytes"] / max(r["rows"], 1)
    for r in results:
        if "step_bytes" in r:
            print(f"{r['drafter']:7} T={r['seq']:5} chunk={r['chunk']:5} rows={r['rows']:6} "
                  f"step {r['step_bytes'] / 2**30:7.2f} GiB  peak RSS {r['peak_rss'] / 2**30:7.2f} GiB  "
                  f"loss {r['loss']}")
        else:
            print(f"{r['drafter']:7} T={r['seq']:5} chunk={r['chunk']:5} {'skipped' if r.get('skipped') else 'failed'}"
                  f" {r.get('estimated_step_bytes', r.get('failed'))}")
    summary = {"vocab": args.vocab, "hidden": args.hidden, "heads": args.heads, "target": args.target,
               "threads": args.threads, "results": results}
    if args.output:
        args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
