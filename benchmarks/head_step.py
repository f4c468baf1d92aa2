"""One Medusa-1 training step of the heads, dense against packed, side by side on the same batches.

The dense step runs the heads on every position of a padded batch (``[K, B, T, V']`` logits) and masks the loss;
the packed step (what ``medusa-train`` does, :func:`medusa_train.training.step.heads_on_batch`) runs them only on
the positions some head is trained on. Both give the same loss and gradient (tested); this measures the time of
forward + backward per batch, alternating the two on each batch of the run's own training data (hidden-state cache).

    python benchmarks/head_step.py                                          # stories260k, its self-distilled data
    python benchmarks/head_step.py --model smollm2_135m --data sharegpt --max-length 320 \\
        --override data.self_distill=true --override data.max_conversations=2400 \\
        --override data.self_distill_dir=runs/long/self_distill --override hidden_cache_dir=runs/long/hidden_cache \\
        --override data.eval_fraction=0.03 --override heads.head_vocab_size=8192 --override model.dtype=float32

Writes ``OUTPUT_DIR/head_step.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import medusa_train  # noqa: F401  (registers schemas and resolvers)
from medusa_train.paths import CONF_DIR
from medusa_train.training.losses import IGNORE_INDEX, head_targets
from medusa_train.training.recipe import TrainRecipe
from medusa_train.training.step import head_loss, heads_on_batch


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="stories260k", help="model/ config group option")
    parser.add_argument("--data", default="stories260k_selfdistill", help="data/ config group option")
    parser.add_argument("--batches", type=int, default=20, help="training batches timed (each both ways)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_head_step"))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    args = parser.parse_args()
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.threads:
        torch.set_num_threads(args.threads)

    overrides = [
        f"model={args.model}", f"data={args.data}", "trainer=cpu",
        f"trainer.per_device_train_batch_size={args.batch_size}",
        f"max_length={args.max_length}", "hidden_cache=true", "export=false", "overwrite=true",
        f"output_dir={args.output_dir / 'run'}", *args.override,
    ]
    if not any(o.startswith("data.self_distill_dir=") for o in args.override):
        overrides.append(f"data.self_distill_dir={args.output_dir / 'self_distill'}")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    if cfg.heads.target == "soft":
        parser.error("heads.target=soft trains on every position (dense): there is no packed step to compare")
    recipe = TrainRecipe(cfg)
    recipe.setup()
    heads, base, spec = recipe.trainer.model, recipe.frozen_base, recipe.loss_spec
    lm_weight = base.lm_head.weight if spec.share_lm_head else None

    def dense(batch):
        logits = heads(batch["hidden"], lm_weight)  # [K, B, T, V']
        head_loss(logits, batch["labels"], spec, base_argmax=batch["base_argmax"]).loss.backward()

    def packed(batch):
        heads_on_batch(heads, base, batch, spec)[0].loss.backward()

    times = {"dense": [], "packed": []}
    positions = {"padded": 0, "counted": 0}
    loader = recipe.trainer.get_train_dataloader()
    for i, batch in enumerate(loader):
        if i == args.batches:
            break
        targets = head_targets(batch["labels"], spec.num_heads, target=spec.target, base_argmax=batch["base_argmax"])
        positions["padded"] += batch["labels"].numel()
        positions["counted"] += int((targets != IGNORE_INDEX).any(0).sum())
        for name, fn in ((("dense", dense), ("packed", packed)) if i % 2 else (("packed", packed), ("dense", dense))):
            heads.zero_grad()
            times[name].append(timed(lambda: fn(batch)))
    recipe.cleanup()

    median = {name: statistics.median(t) for name, t in times.items()}
    share = positions["counted"] / positions["padded"]
    print(f"\nMedusa-1 head step (forward + backward), model={args.model}, data={args.data}, {len(times['dense'])} "
          f"batches of {args.batch_size}, {torch.get_num_threads()} threads")
    print(f"positions some head counts: {positions['counted']} of {positions['padded']} padded ({share:.1%})")
    print(f"{'step':<8}{'median ms':>11}{'speedup':>9}")
    for name in ("dense", "packed"):
        print(f"{name:<8}{median[name] * 1e3:>11.1f}{median['dense'] / median[name]:>8.2f}x")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "head_step.json").write_text(json.dumps(
        {"model": args.model, "data": args.data, "batch_size": args.batch_size, "threads": torch.get_num_threads(),
         "positions": positions, "median_s": median, "times_s": times}, indent=1))


if __name__ == "__main__":
    main()
