"""One training step, dense against packed heads, side by side on the same batches: Medusa-1 or Medusa-2.

The dense step runs the heads on every position of a padded batch (``[K, B, T, V']`` logits; with ``soft`` targets
also the base's full lm_head) and masks the loss; the packed step (what ``medusa-train`` does,
:class:`medusa_train.training.step.HeadTargets`) runs them only on the positions some head is trained on (with
``soft``, the base's distributions only where they are targets, over the head vocabulary). Both give the same loss
and gradient (tested); this measures the time of forward + backward per batch, alternating the two on each batch of
the run's own training data. Medusa-1 reads the hidden-state cache (the heads' step alone); Medusa-2
(``--override heads=medusa2``) runs the whole joint step: the base with its LoRA adapters, its loss and the heads.

    python benchmarks/head_step.py                                          # stories260k, its self-distilled data
    python benchmarks/head_step.py --model smollm2_135m --data sharegpt --max-length 320 \\
        --override data.self_distill=true --override data.max_conversations=2400 \\
        --override data.self_distill_dir=runs/long/self_distill --override hidden_cache_dir=runs/long/hidden_cache \\
        --override data.eval_fraction=0.03 --override heads.head_vocab_size=8192 --override model.dtype=float32
    python benchmarks/head_step.py --override heads=medusa2 --batches 10   # Medusa-2 (LoRA) on stories260k

Writes ``OUTPUT_DIR/head_step.json``.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from hydra import compose, initialize_config_dir

from medusa_train.cli.train import register_schemas
from medusa_train.files.paths import CONF_DIR
from medusa_train.training.joint_loss import base_loss_sum
from medusa_train.training.losses import IGNORE_INDEX, head_targets, heads_loss
from medusa_train.training.recipe import FrozenBaseRecipe, JointRecipe, build_recipe
from medusa_train.training.step import heads_on_batch

from training_args import training_overrides, training_parser


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def heads_steps(recipe: FrozenBaseRecipe):
    """Medusa-1 on the hidden-state cache: (dense, packed) forward + backward of the heads on one batch."""
    heads, base, spec = recipe.trainer.model, recipe.frozen_base, recipe.loss_spec
    lm_weight = base.lm_head.weight if spec.share_lm_head else None

    def dense(batch):
        logits = heads(batch["hidden"], lm_weight)  # [K, B, T, V']
        base_logits = base.logits(batch["hidden"]) if spec.target == "soft" else None  # [B, T, V]
        heads_loss(logits, batch["labels"], target=spec.target, decay=spec.decay,
                         base_argmax=batch["base_argmax"], base_logits=base_logits, token_map=spec.token_map,
                         vocab_size=spec.vocab_size).loss.backward()

    def packed(batch):
        heads_on_batch(heads, base, batch, spec).loss.backward()

    return dense, packed


def joint_steps(recipe: JointRecipe):
    """Medusa-2: (dense, packed) forward + backward of the joint model (base loss + heads' loss) on one batch."""
    trainer, spec, js = recipe.trainer, recipe.loss_spec, recipe.trainer.joint_spec

    def dense(batch):
        labels = batch["labels"]
        out = trainer.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                            with_reference=js.base_loss == "kl")  # heads at every position: [K, B, T, V']
        base_sum, count = base_loss_sum(js.base_loss, out.logits, labels, out.reference_logits)
        logits = out.logits.detach()
        heads_out = heads_loss(out.head_logits, labels, target=spec.target, decay=spec.decay,
                                     base_argmax=logits.argmax(-1), base_logits=logits, token_map=spec.token_map,
                                     vocab_size=spec.vocab_size, normalizer=count.clamp_min(1))
        (base_sum / count.clamp_min(1) + trainer.medusa_weight() * heads_out.loss).backward()

    def packed(batch):
        trainer.compute_loss(trainer.model, batch).backward()

    return dense, packed


def main() -> None:
    register_schemas()  # what conf/train.yaml composes from
    parser = training_parser(__doc__, "runs/bench_head_step")
    parser.add_argument("--batches", type=int, default=20, help="training batches timed (each both ways)")
    args = parser.parse_args()
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    joint = any(o in ("heads=medusa2", "heads.mode=joint") for o in args.override)
    # --override last: a user's override wins over these (Medusa-2 reads token ids: no hidden-state cache)
    overrides = [f"hidden_cache={str(not joint).lower()}", f"output_dir={args.output_dir / 'run'}",
                 *training_overrides(args)]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    recipe = build_recipe(cfg)
    recipe.setup()
    spec = recipe.loss_spec
    model = recipe.trainer.model
    joint = isinstance(recipe, JointRecipe)
    dense, packed = joint_steps(recipe) if joint else heads_steps(recipe)

    times = {"dense": [], "packed": []}
    positions = {"padded": 0, "counted": 0}
    loader = recipe.trainer.get_train_dataloader()
    for i, batch in enumerate(loader):
        if i == args.batches:
            break
        targets = head_targets(batch["labels"], spec.num_heads, target="labels")
        positions["padded"] += batch["labels"].numel()
        positions["counted"] += int((targets != IGNORE_INDEX).any(0).sum())
        for name, fn in ((("dense", dense), ("packed", packed)) if i % 2 else (("packed", packed), ("dense", dense))):
            model.zero_grad()
            times[name].append(timed(lambda: fn(batch)))
    recipe.cleanup()

    median = {name: statistics.median(t) for name, t in times.items()}
    share = positions["counted"] / positions["padded"]
    flow = "Medusa-2 joint step" if joint else "Medusa-1 head step"
    print(f"\n{flow} (forward + backward), model={args.model}, data={args.data}, {len(times['dense'])} "
          f"batches of {args.batch_size}, {torch.get_num_threads()} threads")
    print(f"positions some head counts: {positions['counted']} of {positions['padded']} padded ({share:.1%})")
    print(f"{'step':<8}{'median ms':>11}{'speedup':>9}")
    for name in ("dense", "packed"):
        print(f"{name:<8}{median[name] * 1e3:>11.1f}{median['dense'] / median[name]:>8.2f}x")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "head_step.json").write_text(json.dumps(
        {"flow": "medusa2" if joint else "medusa1", "model": args.model, "data": args.data,
         "batch_size": args.batch_size, "threads": torch.get_num_threads(),
         "positions": positions, "median_s": median, "times_s": times}, indent=1))


if __name__ == "__main__":
    main()
