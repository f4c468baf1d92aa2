"""Hydra heads against Medusa-1 heads: same data, same head count, each with its own tuned tree, same held-out prompts.

Steps (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", compare the two the same
way: one tree decoding, one verification, heads trained on the same self-distilled data):

1. **train** (unless ``--medusa`` / ``--hydra`` name existing exports): ``medusa-train heads=medusa1`` and
   ``heads=hydra`` with the same overrides (default: the stories260K recipe, ``model=stories260k
   data=stories260k_selfdistill``, its 10 epochs and 4 heads), sharing one self-distilled data folder;
2. **tune** each export's tree with ``medusa-tune-tree`` on the tuning prompts (``--retune``; default: only exports
   without a ``medusa_choices.json``), against one verification latency profile: the Medusa-1 export's, measured
   when it is tuned and reused for the Hydra export (``latency_from``; same base, same device), so the two trees
   are not chosen against different timing noise;
3. **decode** the evaluation prompts (first turns) with plain greedy decoding and both tree decoders, greedy
   acceptance, interleaved per prompt (``inference.evaluation.runner``: the machine's drift hits all alike), one base
   model shared by both heads;
4. **head accuracy**: top-1 of each head on the evaluation prompts' greedy continuations, teacher forced (for Hydra
   heads: given the true path, the one greedy verification can accept);
5. **fixed budgets**: for trees of ``--budgets`` nodes grown best-first from each export's tuning table, the mean
   accepted tokens greedy verification gives on the evaluation prompts, replayed from the recorded ranks
   (:mod:`inference.tuning.replay`, equal to the decoder's counts: tested). It compares heads without the
   tuner's latency profile, which on a shared CPU is noisy.

Prints one table (head-wise top-1, tree nodes, mean accepted tokens τ, tokens/s, speedup over plain greedy, exact
match, drafting and verification ms per step) and writes ``OUTPUT_DIR/hydra_vs_medusa.json`` with the rows.

The stories260K held-out prompts (``data/stories260k_heldout.jsonl``, 48 story openings none of the training
prompts): the first 16 tune the trees, the other 32 are decoded.

    python benchmarks/hydra_vs_medusa.py --output-dir runs/hydra_vs_medusa --threads 1
    python benchmarks/hydra_vs_medusa.py --output-dir runs/hvm_sum --hydra-override heads.combine=sum
    # later, SmolLM2 with the quickstart's data (both exports trained, e.g. by launch/quickstart.sh and its Hydra twin):
    python benchmarks/hydra_vs_medusa.py --medusa runs/quickstart/export --hydra runs/quickstart_hydra/export \\
        --tune-prompts sharegpt --tune-num-prompts 64 --prompts mt_bench --max-new-tokens 256 \\
        --output-dir runs/hydra_vs_medusa_smollm2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from inference.cli.tune_tree import register_schemas
from inference.decoders import TreeDecoder, VanillaDecoder
from inference.decoders.base import DecodeConfig
from inference.decoders.chat import eos_ids
from inference.decoders.choices import resolve_medusa_choices
from inference.evaluation.results import ResultsLog
from inference.evaluation.runner import evaluate_prompts
from inference.evaluation.summary import decoder_metrics, complete_units, step_times
from inference.tuning.accuracy import measure_head_accuracy
from inference.tuning.replay import replayed_accept_length
from inference.tuning.search import greedy_tree
from medusa_train.export import load_heads
from inference.conf import CONF_DIR as INFERENCE_CONF_DIR
from medusa_train.export.tree_files import read_tree_files
from medusa_train.loading.cpu_kernels import apply_cpu_kernels
from medusa_train.loading.export import check_export_base, load_export, model_config_for_export
from medusa_train.loading.runtime import decide_runtime
from medusa_train.models.speculative import SpeculativeModel
from medusa_train.files.paths import CONF_DIR, REPO_ROOT
from medusa_train.chat.prompts import encode_prompt, load_prompts
from medusa_train.training.recipe import build_recipe

STORIES_HELDOUT = REPO_ROOT / "data" / "stories260k_heldout.jsonl"
HEADS = {"medusa1": "medusa1", "hydra": "hydra"}  # result name -> heads/ config group option


def train(name: str, out: Path, overrides: list[str]) -> Path:
    """``medusa-train heads=<name>`` into ``out/<name>``; returns the export folder."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"heads={HEADS[name]}", f"output_dir={out / name}", *overrides])
    start = time.perf_counter()
    summary = build_recipe(cfg).run()
    print(f"{name}: trained {summary['global_step']} steps in {time.perf_counter() - start:.0f} s", flush=True)
    return Path(summary["export_dir"])


def tune(export: Path, args: argparse.Namespace, latency_from: Path | None = None) -> None:
    """``medusa-tune-tree`` on the tuning prompts (``latency_from``: reuse that export's latency profile)."""
    from inference.cli.tune_tree import run

    overrides = [f"export_dir={export}", f"prompts.num_prompts={args.tune_num_prompts}",
                 f"max_new_tokens={args.max_new_tokens}", f"topk={args.topk}", f"max_nodes={args.max_nodes}",
                 "timed_prompts=0"]  # both trees from one latency profile: no timing noise of their own
    if latency_from is not None:
        overrides.append(f"latency_from={latency_from}")
    overrides += prompt_overrides("prompts", args.tune_prompts, args.tune_offset)
    if args.dtype:
        overrides.append(f"dtype={args.dtype}")
    with initialize_config_dir(str(INFERENCE_CONF_DIR), version_base="1.3"):
        run(compose("tune_tree", overrides=overrides))


def prompt_overrides(key: str, source: str, offset: int | None) -> list[str]:
    out = [f"{key}.source={source}"] if source in ("sharegpt", "mt_bench") else [f"{key}.source=jsonl",
                                                                                f"{key}.path={source}"]
    return out + ([f"{key}.offset={offset}"] if offset is not None else [])


def main() -> None:
    register_schemas()  # what conf/tune_tree.yaml composes from (the shared schemas, conf/train.yaml's, included)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--medusa", type=Path, help="an existing Medusa-1 export (else trained)")
    parser.add_argument("--hydra", type=Path, help="an existing Hydra export (else trained)")
    parser.add_argument("--train-override", action="append", default=[],
                        help="Hydra override for both training runs (repeatable)")
    parser.add_argument("--medusa-override", action="append", default=[], help="... for the Medusa-1 run only")
    parser.add_argument("--hydra-override", action="append", default=[], help="... for the Hydra run only")
    parser.add_argument("--retune", action="store_true", help="tune trees even where the export has one")
    parser.add_argument("--tune-prompts", default=str(STORIES_HELDOUT), help="sharegpt | mt_bench | a JSONL file")
    parser.add_argument("--tune-offset", type=int, default=None)
    parser.add_argument("--tune-num-prompts", type=int, default=16)
    parser.add_argument("--prompts", default=str(STORIES_HELDOUT), help="sharegpt | mt_bench | a JSONL file")
    parser.add_argument("--prompt-offset", type=int, default=None,
                        help="first evaluation prompt (default: 16 for the stories file, past the tuning ones)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--max-nodes", type=int, default=63, help="largest tree the tuner considers")
    parser.add_argument("--budgets", type=int, nargs="*", default=[15, 31, 63],
                        help="tree sizes (nodes, root excluded) whose replayed τ is reported")
    parser.add_argument("--dtype", default=None, help="decode dtype (default: the model config's)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)

    common = ["export_vllm=false", "trainer.disable_tqdm=true", "overwrite=true",
              f"data.self_distill_dir={out / 'self_distill'}", *args.train_override]
    exports = {"medusa1": args.medusa, "hydra": args.hydra}
    for name, extra in (("medusa1", args.medusa_override), ("hydra", args.hydra_override)):
        if exports[name] is None:
            exports[name] = train(name, out, [*common, *extra])
    if args.retune or "medusa_choices" not in read_tree_files(exports["medusa1"]):
        tune(exports["medusa1"], args)
    if args.retune or "medusa_choices" not in read_tree_files(exports["hydra"]):
        shared = exports["medusa1"] if "latency_profile" in read_tree_files(exports["medusa1"]) else None
        tune(exports["hydra"], args, latency_from=shared)

    # one base model, both heads (the exports must record the same base)
    model, tokenizer, config = load_export(str(exports["medusa1"]), dtype=args.dtype, head_type="medusa")
    check_export_base(exports["hydra"], model_config_for_export(config), "--hydra")
    weight = model.lm_head.weight
    # the kernels medusa-eval and medusa-tune-tree decode on (cpu_kernels=auto), shared by all three decoders
    _, kernels = decide_runtime(str(weight.dtype).removeprefix("torch."), weight.device, "auto")
    apply_cpu_kernels(model.base, kernels)
    hydra_heads, _ = load_heads(exports["hydra"], base_model=model.base, head_type="hydra")
    hydra = SpeculativeModel(model.base, hydra_heads.to(weight.device, weight.dtype).eval())
    models = {"medusa1": model, "hydra": hydra}
    trees = {name: resolve_medusa_choices(None, str(exports[name]), m.heads.spec.num_heads, args.topk)
             for name, m in models.items()}
    decoders = {"vanilla": VanillaDecoder(model.base, tokenizer=tokenizer)}
    decoders.update({name: TreeDecoder(m, trees[name], topk=args.topk, acceptance="greedy", tokenizer=tokenizer)
                     for name, m in models.items()})

    offset = args.prompt_offset
    if offset is None and Path(args.prompts).resolve() == STORIES_HELDOUT.resolve():
        offset = args.tune_num_prompts
    source = args.prompts if args.prompts in ("sharegpt", "mt_bench") else "jsonl"
    prompts = load_prompts(source, None if source != "jsonl" else args.prompts, offset, args.num_prompts)
    request = DecodeConfig(max_new_tokens=args.max_new_tokens,
                           eos_token_ids=eos_ids(tokenizer, getattr(model.base, "generation_config", None)))
    results_file = out / "results.jsonl"
    results_file.unlink(missing_ok=True)
    rows = evaluate_prompts(decoders, tokenizer, prompts, request, ResultsLog(results_file), max_turns=1,
                            progress=False).rows
    units = list(complete_units(rows).values())
    metrics, times = decoder_metrics(units, greedy=True), step_times(rows)

    token_prompts = [encode_prompt(tokenizer, p.first_turn_messages()) for p in prompts]
    eos = request.eos_token_ids[0] if request.eos_token_ids else None
    measured = {name: measure_head_accuracy(m, token_prompts, max_new_tokens=args.max_new_tokens, topk=args.topk,
                                            eos_token_id=eos) for name, m in models.items()}
    accuracy = {name: r["acc"] for name, r in measured.items()}
    budgets = {name: {n: replayed_accept_length(measured[name]["target_ranks"],
                                                greedy_tree(read_tree_files(exports[name])["head_accuracy"]["acc"], n))
                      for n in args.budgets} for name in models}
    report: dict[str, Any] = {"prompts": len(prompts), "prompt_source": args.prompts, "prompt_offset": offset,
                              "max_new_tokens": args.max_new_tokens, "dtype": str(weight.dtype),
                              "cpu_kernels": kernels.record(),
                              "threads": torch.get_num_threads(), "exports": {k: str(v) for k, v in exports.items()},
                              "trees": trees, "decoders": {}}
    K = max(m.heads.spec.num_heads for m in models.values())
    print(f"\n{len(prompts)} held-out prompts x {args.max_new_tokens} tokens, {weight.dtype}, "
          f"{torch.get_num_threads()} threads")
    print("| decoder | " + " | ".join(f"head {k} top-1" for k in range(K)) + " | tree nodes | τ | tokens/s | speedup "
          "| exact match | draft ms/step | verify ms/step | " + " | ".join(f"τ, {n}-node tree" for n in args.budgets)
          + " |")
    print("| --- " * (K + 8 + len(args.budgets)) + "|")
    for name, m in metrics.items():
        top1 = [row[0] for row in accuracy[name]] if name in accuracy else []
        t = times.get(name, {})
        row = {**m, "top1": top1, "tree_nodes": len(trees[name]) if name in trees else None, **t,
               "replayed_tau_by_budget": budgets.get(name, {})}
        report["decoders"][name] = row
        cells = [f"{x:.3f}" for x in top1] + ["-"] * (K - len(top1))
        print(f"| {name} | " + " | ".join(cells) + f" | {row['tree_nodes'] or '-'} | "
              f"{m['mean_accepted_tokens']:.3f} | {m['tokens_per_second']:.1f} | {m['speedup']:.2f}x | "
              f"{m['exact_match_vs_greedy']:.2f} | {_ms(t.get('draft_ms_per_step'))} | "
              f"{_ms(t.get('verify_ms_per_step'))} | "
              + " | ".join(f"{budgets[name][n]:.3f}" if name in budgets else "-" for n in args.budgets) + " |")
    tau = {n: metrics[n]["mean_accepted_tokens"] for n in models}
    report["tau_ratio_hydra_over_medusa1"] = tau["hydra"] / tau["medusa1"]
    print(f"τ hydra / medusa1: {report['tau_ratio_hydra_over_medusa1']:.3f}")
    (out / "hydra_vs_medusa.json").write_text(json.dumps(report, indent=1))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
