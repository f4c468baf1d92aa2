"""One Medusa-1 training step of the heads, dense against packed, side by side on the same batches.

The dense step runs the heads on every position of a padded batch (``[K, B, T, V']`` logits; with ``soft`` targets
also the base's full lm_head) and masks the loss; the packed step (what ``medusa-train`` does,
:func:`medusa_train.training.step.heads_on_batch`) runs them only on the positions some head is trained on (with
``soft``, the base's distributions only where they are targets, over the head vocabulary). Both give the same loss
and gradient (tested); this measures the time of forward + backward per batch, alternating the two on each batch of
the run's own training data (hidden-state cache).

    python benchmarks/head_step.py                                          # stories260k, its self-distilled data
    python benchmarks/head_step.py --model smollm2_135m --data sharegpt --max-length 320 \\
        --override data.self_distill=true --override data.max_conversations=2400 \\
        --override data.self_distill_dir=runs/long/self_distill --override hidden_cache_dir=runs/long/hidden_cache \\
        --override data.eval_fraction=0.03 --override heads.head_vocab_size=8192 --override model.dtype=float32

Writes ``OUTPUT_DIR/head_step.json``.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from hydra import compose, initialize_config_dir

import medusa_train  # noqa: F401  (registers schemas and resolvers)
from medusa_train.paths import CONF_DIR
from medusa_train.training.losses import IGNORE_INDEX, head_targets
from medusa_train.training.recipe import TrainRecipe
from medusa_train.training.step import head_loss, heads_on_batch

from training_args import training_overrides, training_parser


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = training_parser(__doc__, "runs/bench_head_step")
    parser.add_argument("--batches", type=int, default=20, help="training batches timed (each both ways)")
    args = parser.parse_args()
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    # --override last: a user's override wins over these
    overrides = ["hidden_cache=true", f"output_dir={args.output_dir / 'run'}", *training_overrides(args)]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    recipe = TrainRecipe(cfg)
    recipe.setup()
    heads, base, spec = recipe.trainer.model, recipe.frozen_base, recipe.loss_spec
    lm_weight = base.lm_head.weight if spec.share_lm_head else None

    def dense(batch):
        logits = heads(batch["hidden"], lm_weight)  # [K, B, T, V']
        base_logits = base.logits(batch["hidden"]) if spec.target == "soft" else None  # [B, T, V]
        head_loss(logits, batch["labels"], spec, base_argmax=batch["base_argmax"],
                  base_logits=base_logits).loss.backward()

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
