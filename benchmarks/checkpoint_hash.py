"""What the checkpoint checksums cost: the time to write one checkpoint of a set of heads against the time to seal it
(:func:`medusa_train.training.checkpoints.mark_complete`: sizes and sha256 of every file) and to verify it before a
resume (``incomplete_reason(..., verify=True)``).

The checkpoint is written as the Trainer writes one for Medusa-1: the heads' ``model.safetensors`` and the AdamW
state (``optimizer.pt``, two fp32 moments per weight: twice the heads' size), after one real optimizer step. The files
were just written, so hashing mostly reads the page cache (as it does in training); verification before a resume may
read from disk and then runs at the disk's speed instead.

    python benchmarks/checkpoint_hash.py                                        # SmolLM2-135M's heads: H=576, V=49152
    python benchmarks/checkpoint_hash.py --hidden 4096 --vocab 32000 --heads 5  # Vicuna-7B's (about 9 GB; RAM!)

Writes ``OUTPUT_DIR/checkpoint_hash.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.training import checkpoints


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_checkpoint_hash"))
    args = parser.parse_args()

    spec = HeadsSpec(num_heads=args.heads, num_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab)
    heads = MedusaHeads(spec)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)
    sum(p.sum() for p in heads.parameters()).backward()
    optimizer.step()
    folder = args.output_dir / "checkpoint-1"
    rows = []
    for _ in range(args.repeats):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

        def write() -> None:
            save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(folder / "model.safetensors"))
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")
            for f in folder.iterdir():
                with open(f, "rb+") as handle:
                    os.fsync(handle.fileno())

        rows.append({"write_s": timed(write),
                     "seal_s": timed(lambda: checkpoints.mark_complete(folder, 1)),
                     "verify_s": timed(lambda: checkpoints.incomplete_reason(folder, verify=True))})
        assert checkpoints.incomplete_reason(folder, verify=True) is None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.name != checkpoints.COMPLETE_MARKER)
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result = {"heads": vars(args) | {"output_dir": str(args.output_dir)}, "checkpoint_bytes": size,
              "cpu_threads": os.cpu_count(), **{k: round(v, 3) for k, v in median.items()},
              "seal_over_write": round(median["seal_s"] / median["write_s"], 3),
              "hash_gb_per_s": round(size / median["verify_s"] / 1e9, 3)}
    (args.output_dir / "checkpoint_hash.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
