"""``medusa-tune-tree export_dir=DIR``: choose ``medusa_choices`` for these heads on this hardware.

The run holds the export folder's lock (:data:`~medusa_train.runs.run_lock.EXPORT_LOCK`) from before the model loads to
the last file written: a second tuning of the folder, or an export into it, is refused while it runs (their timings
would interleave, and the last writer's tree would win).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from inference.conf import CONF_DIR
from inference.tuning.tune_tree_config import register_tune_tree_schema
from medusa_train.cli.app import hydra_app, register_shared_schemas
from medusa_train.config.schema import as_dataclass
from medusa_train.runs.run_lock import EXPORT_LOCK, RunLock

if TYPE_CHECKING:
    from inference.tuning.tune_tree_config import TuneTreeConfig


def register_schemas() -> None:
    """What ``conf/tune_tree.yaml`` composes from: ``tune_tree_schema``, the shared schemas and resolvers
    (idempotent)."""
    register_shared_schemas()
    register_tune_tree_schema()


def run(cfg: DictConfig) -> dict:
    """Tune ``cfg.export_dir`` holding its lock; returns :func:`~inference.tuning.tune.tune_tree`'s result.

    Raises:
        LockHeldError: another process holds the export folder (its pid, host and command named).
    """
    from inference.tuning.tune_tree_config import TuneTreeConfig

    tc = as_dataclass(TuneTreeConfig, cfg)
    with RunLock.acquire(tc.export_dir, EXPORT_LOCK, field="export_dir"):
        return _run(tc)


def _run(tc: TuneTreeConfig) -> dict:
    from medusa_train.loading.runtime import load_for_inference
    from inference.tuning.timed import describe_choice
    from medusa_train.chat.prompts import load_prompts
    from inference.tuning.tune import tune_tree

    # the prompts first: a malformed prompt file is named before the model loads
    prompts = load_prompts(tc.prompts.source, tc.prompts.path, tc.prompts.offset, tc.prompts.num_prompts)
    model, tokenizer, _, runtime = load_for_inference(tc.export_dir, model=tc.model, dtype=tc.dtype, device=tc.device,
                                                      cpu_kernels=tc.cpu_kernels)
    if tc.topk > model.heads.spec.out_size:
        raise ValueError(f"topk={tc.topk} exceeds the heads' vocabulary of {model.heads.spec.out_size}")
    result = tune_tree(model, tokenizer, prompts, tc, runtime.record())
    acc = result["head_accuracy"]["acc"]
    print("head  " + "  ".join(f"top{i + 1:<3d}" for i in range(min(5, len(acc[0])))))
    for k, row in enumerate(acc):
        cumulative = [sum(row[: i + 1]) for i in range(min(5, len(row)))]
        print(f"{k:>4d}  " + "  ".join(f"{c:6.3f}" for c in cumulative))
    chosen = result["chosen"]
    if chosen["by"] == "timed":
        print(f"decoding {chosen['timed_prompts']} tuning prompts x {tc.timed_new_tokens} tokens with each shortlisted tree:")
        for n, row in sorted(chosen["timed"].items(), key=lambda kv: int(kv[0])):
            predicted = result["rates"][int(n)]["tokens_per_s"]
            print(f"  {int(n) - 1:>3d} nodes  {row['tokens_per_s']:7.2f} tokens/s  tau {row['mean_accepted_tokens']:.2f}"
                  f"  {row['step_ms']:6.1f} ms a step  (predicted {predicted:.2f})")
        print(f"kept {chosen['nodes']} nodes (the latency profile's best: {chosen['predicted_nodes']}; "
              f"{describe_choice(chosen.get('margin'))})")
    print(f"tree: {len(result['medusa_choices'])} nodes, mean accepted tokens "
          f"{result['replayed_accept_length']:.3f} replayed on the tuning prompts "
          f"({result['expected_accept_length']:.3f} by the independent-heads formula); written to {tc.export_dir}")
    print(json.dumps(result["medusa_choices"]))
    if result["dynamic_tree"] is not None:
        print_dynamic_tree(result["dynamic_tree"], tc.export_dir)
    if result["composite_tree"] is not None:
        print_composite_tree(result["composite_tree"], tc.export_dir)
    return result


def print_timed_choice(record: dict, what: str, columns: list[tuple[str, str]], describe: Callable[[dict], str],
                       written: str) -> None:
    """A choice made by decoding a shortlist (a dynamic tree's shape, the composite tree's split): the timed rows,
    ``columns`` (header, key) first, then what was kept and why (:func:`inference.tuning.timed.choose`)."""
    from inference.tuning.timed import describe_choice

    chosen = record["chosen"]
    if chosen["by"] == "timed":
        print(f"decoding {chosen['timed_prompts']} tuning prompts x {chosen['timed_new_tokens']} tokens with each "
              f"shortlisted {what}:")
        print("  " + "  ".join(header for header, _ in columns) + "  tokens/s   tau  ms a step")
        for row in chosen["timed"]:
            reference = "  (reference)" if describe(row) == describe(chosen["reference"]) else ""
            print("  " + "  ".join(f"{row[key]:>{len(header)}d}" for header, key in columns)
                  + f"  {row['tokens_per_s']:8.2f}  {row['mean_accepted_tokens']:4.2f}  {row['step_ms']:9.1f}"
                  + reference)
        print(f"kept the {what} of {describe(record)} (the reference: {describe(chosen['reference'])}; "
              f"{describe_choice(chosen.get('margin'), 'reference', 'reference')})")
    else:
        print(f"{what}: {describe(record)}, the reference, not decoded (timed_prompts=0)")
    print(f"written to {written}")


def print_dynamic_tree(dynamic: dict, export_dir: str) -> None:
    """The dynamic tree's timed shortlist and choice (:func:`inference.tuning.dynamic.tune_dynamic_tree`)."""
    print_timed_choice(dynamic, "dynamic tree", [("depth", "depth"), ("topk", "topk"), ("total", "total")],
                       lambda d: f"depth {d['depth']}, topk {d['topk']}, total {d['total']}",
                       f"{export_dir}/dynamic_tree.json: the decoder's default for this drafter "
                       "(decoder.tree.dynamic_tree or medusa_choices overrides it)")


def print_composite_tree(composite: dict, export_dir: str) -> None:
    """The composite tree's timed splits and choice (:func:`inference.tuning.composite.tune_composite`)."""
    print_timed_choice(composite, "composite tree", [("heads", "heads_nodes"), ("lookup", "lookup_length"),
                                                     ("matches", "lookup_matches"), ("nodes", "nodes")],
                       lambda d: (f"{d['heads_nodes']} heads' nodes + {d['lookup_matches']} x {d['lookup_length']} "
                                  f"lookup tokens ({d['nodes']} nodes)"),
                       f"{export_dir}/composite_tree.json: medusa-eval's composite decoder reads it")


@hydra_app("tune_tree", example='medusa-tune-tree export_dir=runs/stories/export',
           register_schemas=register_schemas, conf_dir=CONF_DIR)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
