"""Training throughput of Medusa-1 heads with and without the hidden-state cache, side by side in one run.

Both runs train the same heads on the same data in the same order (``medusa-train`` with ``hidden_cache=false`` and
``true``); the table gives real (non-padding) tokens per second of ``trainer.train()`` and, for the cache, the
one-time cost of building it (one base forward pass per sequence).

    python benchmarks/train_throughput.py                                   # stories260k, its self-distilled data
    python benchmarks/train_throughput.py --model smollm2_135m --data sharegpt \\
        --override data.max_conversations=200 --max-length 512              # SmolLM2-135M on ShareGPT (CPU: minutes)

Writes ``OUTPUT_DIR/train_throughput.json`` next to the two runs' folders.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from medusa_train.cli.train import register_schemas
from medusa_train.files.paths import CONF_DIR
from medusa_train.training.recipe import build_recipe

from training_args import training_overrides, training_parser


class CountingCollator:
    """Wraps a collator and counts the real tokens (``attention_mask`` ones) of every batch it builds."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tokens = 0

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        batch = self.inner(features)
        self.tokens += int(batch["attention_mask"].sum())
        return batch


def run_once(overrides: list[str], hidden_cache: bool) -> dict[str, Any]:
    """Set up and train one run; returns its timings and token count."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"hidden_cache={str(hidden_cache).lower()}"])
    recipe = build_recipe(cfg)
    start = time.perf_counter()
    recipe.setup()  # loads the model and data; builds the cache when hidden_cache=true
    setup_s = time.perf_counter() - start
    counter = CountingCollator(recipe.trainer.data_collator)
    recipe.trainer.data_collator = counter
    start = time.perf_counter()
    recipe.trainer.train()
    train_s = time.perf_counter() - start
    recipe.cleanup()
    return {"hidden_cache": hidden_cache, "setup_s": round(setup_s, 2), "train_s": round(train_s, 2),
            "steps": recipe.trainer.state.global_step, "tokens": counter.tokens,
            "tokens_per_second": round(counter.tokens / train_s, 1)}


def main() -> None:
    register_schemas()  # what conf/train.yaml composes from
    parser = training_parser(__doc__, "runs/bench_train_throughput")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    args = parser.parse_args()
    common = [
        f"trainer.max_steps={args.steps}", "trainer.save_steps=1000000", "trainer.disable_tqdm=true",
        "trainer.logging_steps=1000000", *training_overrides(args),
    ]
    rows = []
    for cached in (False, True):
        out = args.output_dir / ("cached" if cached else "base_pass")
        rows.append(run_once([f"output_dir={out}", *common], hidden_cache=cached))

    base = rows[0]["tokens_per_second"]
    print(f"\nMedusa-1 head training, model={args.model}, data={args.data}, {args.steps} steps of "
          f"{args.batch_size} conversations, {torch.get_num_threads()} threads")
    print(f"{'mode':<14}{'tokens':>9}{'train s':>10}{'tokens/s':>11}{'speedup':>9}{'setup s':>10}")
    for row in rows:
        mode = "hidden cache" if row["hidden_cache"] else "base pass"
        print(f"{mode:<14}{row['tokens']:>9}{row['train_s']:>10.2f}{row['tokens_per_second']:>11.1f}"
              f"{row['tokens_per_second'] / base:>8.2f}x{row['setup_s']:>10.2f}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "train_throughput.json").write_text(json.dumps(
        {"model": args.model, "data": args.data, "steps": args.steps, "batch_size": args.batch_size,
         "threads": torch.get_num_threads(), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
