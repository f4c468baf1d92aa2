"""The baselines side by side: plain decoding, draft-model speculative decoding, Lookahead decoding and the Hugging Face
peers (assisted generation, prompt lookup), on the same prompts, in the same run, interleaved per prompt.

Defaults: SmolLM2-135M-Instruct (``model/smollm2_135m``, bf16) over the first MT-Bench first turns, greedy. The
draft of ``draft`` and ``hf_assisted`` is the same: the target's first ``--draft-layers`` layers with its final norm
and lm_head (SmolLM2-135M has no smaller sibling), K = ``--num-draft-tokens`` for both. Every decoder first decodes a
short warm-up reply; then, prompt by prompt, each decoder decodes the same prompt in turn, so that machine noise
spreads over all of them. Both drafting decoders stop drafting early after a token the draft gave less than
``--confidence-threshold`` probability (transformers' default for ``hf_assisted``, 0.4; 0 drafts K tokens always).

    python benchmarks/baselines.py --num-prompts 3 --max-new-tokens 64
    python benchmarks/baselines.py --category coding --num-prompts 10 --max-new-tokens 256 --threads 2

Prints and writes ``OUTPUT_DIR/baselines.md`` and ``OUTPUT_DIR/baselines.json``: per decoder tokens/s (new tokens /
wall time, prefill included, summed over prompts), speedup (tokens/s / vanilla's), mean accepted tokens τ (new tokens
after the prefill's / target decoding passes; 1.0 for vanilla; derived from the target's calls for the HF peers, see
``inference/decoders/hf_peers.py``) and exact match with vanilla's reply (all are greedy and lossless: 1.0 expected
in fp32; bf16 may differ where two logits tie within rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from inference.decoders.base import DecodeConfig, DecodeResult, Decoder
from inference.decoders.chat import eos_ids
from inference.decoders.draft import DraftDecoder
from inference.decoders.hf_peers import HfAssistedDecoder, HfPromptLookupDecoder
from inference.decoders.lookahead import LookaheadDecoder
from inference.decoders.vanilla import VanillaDecoder
from inference.draft_loading import self_layer_draft
from inference.evaluation.summary import decoder_metrics, markdown_table
from medusa_train.cli.app import register_shared_schemas
from medusa_train.config.schema import ModelConfig, as_dataclass
from medusa_train.loading.base import load_base_model
from medusa_train.files.paths import CONF_DIR
from medusa_train.chat.prompts import encode_prompt, load_prompts

DECODERS = ("vanilla", "draft", "lookahead", "hf_assisted", "hf_prompt_lookup")


def load_model(name: str, dtype: str | None, device: str | None) -> tuple[Any, Any, ModelConfig]:
    """The target from a ``model/`` config, with optional dtype/device overrides."""
    overrides = [f"model.{k}={v}" for k, v in (("dtype", dtype), ("device", device)) if v]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        node = compose(f"model/{name}", overrides=overrides).model
    cfg = as_dataclass(ModelConfig, node)
    model, tokenizer = load_base_model(cfg)
    return model, tokenizer, cfg


def build_decoders(names: list[str], model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Decoder]:
    draft = self_layer_draft(model, args.draft_layers) if {"draft", "hf_assisted"} & set(names) else None
    makers = {
        "vanilla": lambda: VanillaDecoder(model, tokenizer=tokenizer),
        "draft": lambda: DraftDecoder(model, draft, args.num_draft_tokens, args.schedule, tokenizer=tokenizer,
                                      confidence_threshold=args.confidence_threshold),
        "lookahead": lambda: LookaheadDecoder(model, args.window, args.ngram, args.guesses, tokenizer=tokenizer),
        "hf_assisted": lambda: HfAssistedDecoder(model, draft, args.num_draft_tokens, args.schedule,
                                                 args.confidence_threshold, tokenizer=tokenizer),
        "hf_prompt_lookup": lambda: HfPromptLookupDecoder(model, args.prompt_lookup_tokens, tokenizer=tokenizer),
    }
    return {name: makers[name]() for name in names}


def summarize(results: dict[str, list[DecodeResult]]) -> dict[str, dict[str, Any]]:
    """Per decoder: tokens/s, speedup over vanilla, τ, exact match with vanilla, new tokens, wall time (the same
    aggregation ``medusa-eval`` uses, :func:`inference.evaluation.summary.decoder_metrics`)."""
    names = list(results)
    units = [{name: {**dataclasses.asdict(results[name][i]), "new_tokens": results[name][i].new_tokens}
              for name in names} for i in range(len(results[names[0]]))]
    return decoder_metrics(units, greedy=True)


def main() -> None:
    register_shared_schemas()  # model/ files compose from the shared schemas and resolvers
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="model/ config group option")
    parser.add_argument("--dtype", default=None, help="override the model config's dtype (smollm2_135m: bfloat16)")
    parser.add_argument("--device", default=None, help="override the model config's device (cpu, cuda, auto)")
    parser.add_argument("--num-prompts", type=int, default=8, help="first MT-Bench questions (first turns)")
    parser.add_argument("--category", default=None, help="keep one MT-Bench category (e.g. coding)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--decoders", default=",".join(DECODERS), help=f"comma-separated subset of {DECODERS}")
    parser.add_argument("--draft-layers", type=int, default=8, help="layers of the self-layers draft")
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="K of draft and hf_assisted")
    parser.add_argument("--schedule", default="constant", choices=("constant", "heuristic"))
    parser.add_argument("--confidence-threshold", type=float, default=0.4,
                        help="draft and hf_assisted: stop drafting after a token the draft gave less probability "
                             "(transformers' assistant_confidence_threshold, default 0.4); 0: always K tokens")
    parser.add_argument("--window", type=int, default=5, help="Lookahead W")
    parser.add_argument("--ngram", type=int, default=4, help="Lookahead N")
    parser.add_argument("--guesses", type=int, default=5, help="Lookahead G")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="hf_prompt_lookup's K")
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_baselines"))
    args = parser.parse_args()
    names = [n.strip() for n in args.decoders.split(",") if n.strip()]
    unknown = sorted(set(names) - set(DECODERS))
    if unknown or "vanilla" not in names:
        parser.error(f"--decoders must include vanilla and name only {DECODERS}; got {names}")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts and --max-new-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = load_prompts("mt_bench")
    if args.category:
        prompts = [p for p in prompts if p.category == args.category]
        if not prompts:
            parser.error(f"no MT-Bench prompt has category {args.category!r}")
    prompts = prompts[: args.num_prompts]
    model, tokenizer, model_cfg = load_model(args.model, args.dtype, args.device)
    request = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(tokenizer, model.generation_config))
    decoders = build_decoders(names, model, tokenizer, args)
    encoded = [encode_prompt(tokenizer, p.first_turn_messages()) for p in prompts]

    warm = replace(request, max_new_tokens=min(args.warmup_tokens, args.max_new_tokens))
    for decoder in decoders.values():
        decoder.generate(encoded[0], warm)
    results: dict[str, list[DecodeResult]] = {name: [] for name in names}
    start = time.perf_counter()
    for prompt, ids in zip(prompts, encoded):
        for name, decoder in decoders.items():
            results[name].append(decoder.generate(ids, request))
        line = ", ".join(f"{n} {results[n][-1].tokens_per_second:.1f} tok/s" for n in names)
        print(f"[{prompt.id} {prompt.category}, {len(ids)} prompt tokens] {line}", flush=True)
    total = time.perf_counter() - start

    rows = summarize(results)
    header = (f"{args.model} ({model_cfg.dtype}, {model.device}, {torch.get_num_threads()} threads), "
              f"{len(prompts)} MT-Bench first turns{' (' + args.category + ')' if args.category else ''}, "
              f"max_new_tokens={args.max_new_tokens}, greedy; draft: first {args.draft_layers} layers, "
              f"K={args.num_draft_tokens} ({args.schedule}, confidence >= {args.confidence_threshold}); lookahead W={args.window} N={args.ngram} "
              f"G={args.guesses}; {total:.0f} s")
    print(f"\n{header}\n\n{markdown_table(rows)}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "baselines.md").write_text(f"{header}\n\n{markdown_table(rows)}\n")
    summary = {"model": args.model, "device": str(model.device), "dtype": model_cfg.dtype,
               "threads": torch.get_num_threads(), "prompts": len(prompts), "category": args.category,
               "max_new_tokens": args.max_new_tokens, "settings": {k: v for k, v in vars(args).items()
                                                                 if k != "output_dir"},
               "decoders": rows,
               "per_prompt": {n: [{"id": p.id, "tokens_per_second": r.tokens_per_second,
                                   "mean_accepted_tokens": r.mean_accepted_tokens, "new_tokens": r.new_tokens}
                                  for p, r in zip(prompts, runs)] for n, runs in results.items()}}
    (args.output_dir / "baselines.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {args.output_dir / 'baselines.md'} and {args.output_dir / 'baselines.json'}")


if __name__ == "__main__":
    main()
