"""How often vLLM's Medusa drafts our heads' own top-1 token, for ways of writing a reduced head vocabulary that
vLLM 0.32 can load (it needs all V rows per head and loads no token map).

The heads project onto V' < V tokens (``token_map``). vLLM's per-head ``lm_heads`` take V rows, so the rows of the
other V - V' tokens must be filled:

- ``mean`` (what medusa-train writes): the mean of the head's V' rows; that token's logit is the mean of the head's
  logits, never above their maximum, so vLLM's argmax is the head's top-1;
- ``zero``: logit 0, which beats every in-map token wherever the head's logits are all negative;
- ``base``: the base model's lm_head rows, which compete with the head's own rows.

For each fill, the export's ``vllm/`` folder is rewritten into a temporary copy, loaded by the real vLLM (its own
environment), and its drafter is run on the base model's hidden states at every position of our greedy
continuations of MT-Bench first turns; the agreement with our heads' top-1 is counted per head.

    python benchmarks/vllm_head_layouts.py --export runs/quickstart/export --num-prompts 8 --max-new-tokens 64 \\
        --dtype float32 --output layouts.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

FILLS = ("mean", "zero", "base")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export", required=True, help="an export with a reduced head vocabulary (head_vocab_size)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--fills", nargs="+", default=list(FILLS), choices=FILLS)
    p.add_argument("--output", default=None)
    return p.parse_args(argv)


def continuation_hidden(model: Any, tokenizer: Any, num_prompts: int, max_new_tokens: int) -> torch.Tensor:
    """``[N, H]`` last hidden states at the positions of our greedy continuations (each reply's tokens)."""
    from inference.decoders.base import DecodeConfig
    from inference.decoders.chat import eos_ids
    from inference.decoders.vanilla import VanillaDecoder
    from medusa_train.chat.prompts import encode_prompt, load_prompts

    base = model.base
    decoder = VanillaDecoder(base, tokenizer=tokenizer)
    request = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos_ids(tokenizer, base.generation_config))
    states = []
    for prompt in load_prompts("mt_bench", num_prompts=num_prompts):
        ids = encode_prompt(tokenizer, prompt.first_turn_messages())
        reply = decoder.generate(ids, request)
        with torch.inference_mode():
            hidden = base(torch.tensor([ids + reply.tokens]), output_hidden_states=True).hidden_states[-1][0]
        states.append(hidden[len(ids) - 1: len(ids) + len(reply.tokens) - 1])  # the states that drafted the reply
    return torch.cat(states)


def variant(export: Path, folder: Path, fill: str, base_lm_head: torch.Tensor) -> Path:
    """A copy of ``export/vllm`` whose out-of-map projection rows hold ``fill``."""
    from safetensors.torch import load_file, save_file

    from medusa_train.export.configs import VLLM_TOKEN_MAP

    folder.mkdir(parents=True)
    shutil.copy(export / "vllm" / "config.json", folder / "config.json")
    tensors = load_file(export / "vllm" / "model.safetensors")
    token_map = tensors[VLLM_TOKEN_MAP]
    off = torch.ones(base_lm_head.shape[0], dtype=torch.bool)
    off[token_map] = False
    for name, t in tensors.items():
        if name.startswith("lm_heads.") and fill != "mean":
            t[off] = 0 if fill == "zero" else base_lm_head[off].to(t.dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from medusa_train.drafters.medusa.vllm import speculative_config
    from medusa_train.engines.vllm_env import VllmWorker, vllm_python
    from medusa_train.export import read_export_config
    from medusa_train.loading.base import engine_model_path
    from medusa_train.loading.export import export_base_config, load_export

    vllm_python()
    export = Path(args.export)
    config = read_export_config(export)
    if not config.get("head_vocab_size"):
        raise SystemExit(f"{export} has no reduced head vocabulary (head_vocab_size): every fill is the same")
    model, tokenizer, _ = load_export(str(export), dtype=args.dtype)
    hidden = continuation_hidden(model, tokenizer, args.num_prompts, args.max_new_tokens)
    lm_head = model.base.get_output_embeddings().weight.detach()
    with torch.inference_mode():
        ours = model.heads.to_base_tokens(model.heads(hidden, lm_head).argmax(dim=-1)).T  # [N, K]
    path = engine_model_path(export_base_config(export, config))
    k = model.heads.spec.num_heads
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-layouts-") as tmp:
        for fill in args.fills:
            folder = variant(export, Path(tmp) / fill, fill, lm_head.float().cpu())
            spec = {**speculative_config(export), "model": str(folder)}
            with VllmWorker(path, dtype=args.dtype, speculative_config=spec, max_model_len=1024, enforce_eager=True,
                            inspect=True) as worker:
                theirs = torch.tensor(worker.drafts(hidden))
            agree = (theirs == ours).float().mean(dim=0).tolist()
            results[fill] = {"agreement_per_head": agree, "agreement": float((theirs == ours).float().mean())}
            print(f"{fill}: agreement with our heads' top-1 per head " + ", ".join(f"{a:.3f}" for a in agree),
                  flush=True)
    sizes = {"vllm/model.safetensors": (export / "vllm" / "model.safetensors").stat().st_size,
             "medusa_lm_head.safetensors": (export / "medusa_lm_head.safetensors").stat().st_size}
    summary = {"export": str(export), "dtype": args.dtype, "positions": int(hidden.shape[0]), "heads": k,
               "head_vocab_size": config["head_vocab_size"], "vocab_size": config["vocab_size"],
               "file_bytes": sizes, "fills": results}
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print("| fill | " + " | ".join(f"head {h}" for h in range(k)) + " |")
    print("| --- |" + " --- |" * k)
    for fill, r in results.items():
        print(f"| {fill} | " + " | ".join(f"{a:.3f}" for a in r["agreement_per_head"]) + " |")
    return summary


if __name__ == "__main__":
    main()
