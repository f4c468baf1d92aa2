"""Verification cost, kernels and decoder overhead side by side, in one run: what Medusa's speedup is made of.

For each dtype (``--dtypes``) and linear-kernel choice (``--kernels``: PyTorch's ``none``, oneDNN ``packed``) the
base model is loaded once and the variants take turns in every measurement, so drift of the machine hits all alike:

1. **t(k)/t(1)**: a verification pass over k new tokens after ``--context`` cached ones (4-D mask, lm_head over the
   k positions; :class:`inference.tuning.latency.PassTimer`, what ``medusa-tune-tree`` measures), for every k in
   ``--sizes``; fastest of ``--repeats``. Also each variant's t(1) relative to the unpacked t(1) of its dtype.
2. **vanilla**: plain greedy decoding (:class:`~inference.decoders.vanilla.VanillaDecoder`) of
   ``--vanilla-tokens`` tokens after a chat prompt, tokens/s (median of ``--repeats``).
3. **decoder overhead**: Medusa steps (:func:`inference.decoders.tree.tree_step`, greedy, the tree
   ``--tree``) against the bare base forward (backbone + lm_head, mask prepared beforehand) over the same N node
   tokens at the same cache length, pass by pass: overhead = median(step - bare), as a share of median(bare).
   Candidates, mask, verification, compaction, the heads and the host transfer are what the step adds. Heads: an
   export's (``--export``) or fresh ones (``new_heads_for``: identity blocks and the lm_head's projection, with a
   ``--head-vocab`` token map), which accept little: the overhead does not depend on what is accepted.

    python benchmarks/speed.py                                    # SmolLM2-135M, fp32 and bf16, both kernels
    python benchmarks/speed.py --dtypes bfloat16 --sizes 1 2 4 8 16 32 --repeats 11 --threads 2
    python benchmarks/speed.py --export runs/quickstart/export    # the export's base, heads and tuned tree

Prints three tables and writes them to ``--output`` (JSON). Timings on a shared machine are noisy: read the ratios
within one run, and rerun on a quiet machine for figures to quote (``docs/speed.md`` says where they came from).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from inference.decoders.base import DecodeConfig
from inference.decoders.choices import resolve_medusa_choices
from inference.decoders.tree import make_verifier, tree_step, medusa_tree
from inference.decoders.vanilla import VanillaDecoder
from inference.tuning.latency import PassTimer
from medusa_train.models.catalog import tree_drafter
from medusa_train.cli.app import register_shared_schemas
from medusa_train.config.schema import ModelConfig, as_dataclass
from medusa_train.models.features import FINAL
from medusa_train.loading.base import load_base_model
from medusa_train.loading.cpu_kernels import PackedKernels, apply_cpu_kernels, choose_cpu_kernels
from medusa_train.loading.export import load_export
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from medusa_train.files.paths import CONF_DIR
from medusa_train.config.precision import cpu_isa
from medusa_train.chat.prompts import encode_prompt
from medusa_train.tree.kv_cache import preallocated_cache
from medusa_train.tree.masks import additive_mask

DEFAULT_TREE = [[0], [1], [0, 0], [2], [0, 1]]  # 5 nodes (6 tokens a pass with the root): a size medusa-tune-tree chose
PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."


def load_variant(args: argparse.Namespace, dtype: str, kernels: str) -> tuple[SpeculativeModel, Any, PackedKernels]:
    """Base model (+ heads) in ``dtype`` on ``kernels``: the export's, or ``--model``'s with fresh heads; and what
    the conversion did (fp32 packed: the one-row kernel it measured faster)."""
    if args.export:
        model, tokenizer, _ = load_export(args.export, dtype=dtype, device="cpu")
    else:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            node = compose(f"model/{args.model}", overrides=[f"model.dtype={dtype}", "model.device=cpu"]).model
        base, tokenizer = load_base_model(as_dataclass(ModelConfig, node))
        token_map = torch.arange(args.head_vocab) if args.head_vocab else None
        heads = new_heads_for(base, args.heads, token_map=token_map, dtype=base.dtype).eval().requires_grad_(False)
        model = SpeculativeModel(base, heads)
    applied = apply_cpu_kernels(model.base, choose_cpu_kernels(kernels, "cpu", model.base.dtype))
    return model, tokenizer, applied


def pass_ratios(variants: dict[str, SpeculativeModel], sizes: list[int], context: int, repeats: int) -> dict[str, Any]:
    timers = {name: PassTimer(m.base, sizes, context) for name, m in variants.items()}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in variants}
    for r in range(2 + repeats):
        for n in sizes:
            for name, timer in timers.items():
                elapsed = timer.time(n)
                if r >= 2:
                    times[name][n].append(elapsed)
    return {name: {n: min(ts) * 1000 for n, ts in by_n.items()} for name, by_n in times.items()}


def vanilla_speed(variants: dict[str, SpeculativeModel], ids: list[int], tokens: int, repeats: int) -> dict[str, float]:
    decoders = {name: VanillaDecoder(m) for name, m in variants.items()}
    request = DecodeConfig(max_new_tokens=tokens)
    for d in decoders.values():
        d.generate(ids, DecodeConfig(max_new_tokens=4))
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, d in decoders.items():
            rates[name].append(d.generate(ids, request).tokens_per_second)
    return {name: statistics.median(r) for name, r in rates.items()}


class OverheadProbe:
    """Medusa steps of one model on one prompt, each paired with a bare forward over the same node tokens."""

    @torch.no_grad()
    def __init__(self, model: SpeculativeModel, tree_choices: list[list[int]], topk: int, ids: list[int], steps: int):
        self.model = model
        device = model.lm_head.weight.device
        self.tree = medusa_tree(tree_choices, model.heads.spec.num_heads, topk, device=device)
        self.verify = make_verifier("greedy", self.tree, DecodeConfig(max_new_tokens=steps), None)
        self.cache = preallocated_cache(len(ids) + (steps + 1) * (self.tree.max_depth + 1) + self.tree.num_nodes)
        x = torch.tensor([ids], device=device)
        features, _ = model.features(x, cache=self.cache, use_cache=True)
        self.root = model.lm_head(features[FINAL][:, -1]).argmax(-1)
        self.past_valid = torch.ones(1, len(ids), dtype=torch.bool, device=device)
        self.drafter = tree_drafter(model)
        self.drafter.start(features, x, self.past_valid)
        self.position = torch.tensor([len(ids)], device=device)
        self.step_s: list[float] = []
        self.bare_s: list[float] = []
        self.accepted = 0

    @torch.no_grad()
    def run_one(self) -> None:
        model, tree = self.model, self.tree
        n, past = tree.num_nodes, self.past_valid.shape[1]
        tokens = self.drafter.draft(self.root, tree)
        mask = additive_mask(self.past_valid, tree.attn_mask, model.base.dtype)
        positions = self.position[:, None] + tree.position_ids[None, :]
        start = time.perf_counter()
        hidden = model.base.base_model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                                       cache=self.cache, use_cache=True).last_hidden_state
        model.lm_head(hidden)
        self.bare_s.append(time.perf_counter() - start)
        self.cache.crop(-n)
        start = time.perf_counter()
        step = tree_step(model, self.cache, tree, self.drafter, self.root, self.past_valid, self.position,
                         self.verify)
        self.step_s.append(time.perf_counter() - start)
        self.accepted += len(step.tokens[0]) - 1
        assert self.cache.get_seq_length() == past + len(step.tokens[0])
        self.root = step.root
        self.past_valid, self.position = step.past_valid, step.next_position

    def summary(self) -> dict[str, float]:
        diffs = [s - b for s, b in zip(self.step_s, self.bare_s)]
        bare = statistics.median(self.bare_s)
        return {"step_ms": statistics.median(self.step_s) * 1000, "bare_forward_ms": bare * 1000,
                "overhead_ms": statistics.median(diffs) * 1000, "overhead_share": statistics.median(diffs) / bare,
                "accepted_per_step": self.accepted / len(self.step_s)}


def decoder_overhead(variants: dict[str, SpeculativeModel], tree: list[list[int]], topk: int, ids: list[int],
                     steps: int) -> dict[str, dict[str, float]]:
    probes = {name: OverheadProbe(m, tree, topk, ids, steps + 2) for name, m in variants.items()}
    for probe in probes.values():  # warm-up, not counted
        for _ in range(2):
            probe.run_one()
        probe.step_s.clear()
        probe.bare_s.clear()
        probe.accepted = 0
    for _ in range(steps):
        for probe in probes.values():
            probe.run_one()
    return {name: p.summary() for name, p in probes.items()}


def main() -> None:
    register_shared_schemas()  # model/ files compose from the shared schemas and resolvers
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="a model/ config (ignored with --export)")
    parser.add_argument("--export", default=None, help="an export folder: its base, heads and tuned tree")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--kernels", nargs="+", default=["none", "packed"], choices=("none", "packed"))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(range(1, 33)))
    parser.add_argument("--context", type=int, default=300, help="cached tokens before each verification pass")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--vanilla-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="Medusa steps timed per variant")
    parser.add_argument("--tree", default=None, help="medusa_choices as JSON (default: the export's tuned tree, "
                                                     f"else {json.dumps(DEFAULT_TREE)})")
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--heads", type=int, default=4, help="fresh heads (without --export)")
    parser.add_argument("--head-vocab", type=int, default=4096, help="fresh heads' vocabulary (0: the full one)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--output", default="runs/speed.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.sizes) < 1 or 1 not in args.sizes:
        parser.error("--sizes must include 1 (the ratios are to t(1)) and be >= 1")

    variants: dict[str, SpeculativeModel] = {}
    applied: dict[str, PackedKernels] = {}
    tokenizer = None
    for dtype in args.dtypes:
        for kernels in args.kernels:
            name = f"{dtype}/{kernels}"
            variants[name], tokenizer, applied[name] = load_variant(args, dtype, kernels)
            print(f"{name}: {applied[name].describe()}")
    heads = next(iter(variants.values())).heads.spec.num_heads
    if args.tree:
        tree = json.loads(args.tree)
    elif args.export:
        tree = resolve_medusa_choices(None, args.export, heads, args.topk)
    else:
        tree = DEFAULT_TREE
    ids = list(encode_prompt(tokenizer, [{"role": "user", "content": PROMPT}]))
    isa = cpu_isa()
    print(f"CPU {isa['machine']} flags {', '.join(isa['flags'])}; {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}; tree of {len(tree)} nodes ({len(tree) + 1} tokens a pass with the root)")

    sizes = sorted(set(args.sizes))
    latency = pass_ratios(variants, sizes, args.context, args.repeats)
    print(f"\n## t(k)/t(1): a pass over k tokens after {args.context} cached ones, fastest of {args.repeats}\n")
    names = list(variants)
    print("| k | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    print("| t(1) ms | " + " | ".join(f"{latency[n][1]:.1f}" for n in names) + " |")
    for dtype in args.dtypes:
        plain = latency.get(f"{dtype}/none", {}).get(1)
        if plain:
            print(f"| t(1) / {dtype} none | " + " | ".join(
                f"{latency[n][1] / plain:.2f}" if n.startswith(dtype + "/") else "" for n in names) + " |")
    for k in sizes:
        print(f"| {k} | " + " | ".join(f"{latency[n][k] / latency[n][1]:.2f}" for n in names) + " |")

    vanilla = vanilla_speed(variants, ids, args.vanilla_tokens, args.repeats)
    print(f"\n## vanilla greedy decoding, {args.vanilla_tokens} tokens, median of {args.repeats}\n")
    print("| variant | tokens/s | vs none of its dtype |")
    print("| --- | ---: | ---: |")
    for name, rate in vanilla.items():
        plain = vanilla.get(name.split("/")[0] + "/none")
        print(f"| {name} | {rate:.2f} | {rate / plain:.2f}x |" if plain else f"| {name} | {rate:.2f} | |")

    overhead = decoder_overhead(variants, tree, args.topk, ids, args.steps)
    print(f"\n## Medusa decoder overhead: step minus the bare forward over the same {len(tree) + 1} tokens, "
          f"median of {args.steps} steps\n")
    print("| variant | step ms | bare forward ms | overhead ms | overhead share | accepted / step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, o in overhead.items():
        print(f"| {name} | {o['step_ms']:.1f} | {o['bare_forward_ms']:.1f} | {o['overhead_ms']:.2f} | "
              f"{o['overhead_share']:.1%} | {o['accepted_per_step']:.2f} |")

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": isa, "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "context": args.context, "repeats": args.repeats, "tree": tree,
                               "kernels": {n: a.record() for n, a in applied.items()},
                               "latency_ms": {n: {str(k): v for k, v in t.items()} for n, t in latency.items()},
                               "vanilla_tokens_per_second": vanilla, "overhead": overhead}, indent=1))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
