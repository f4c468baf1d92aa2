"""Why a llama.cpp speculative row can leave plain llama.cpp's greedy reply: the probabilities at the first token where
they differ, computed in a batch of tokens (as a verification pass computes them) and in a one-token decoding step
(as plain decoding does).

    python benchmarks/llamacpp_near_ties.py --run runs/coder/llamacpp-humaneval \\
        --output docs/coder-1.5b-llamacpp-ties.json

For every row of ``--run`` (a ``medusa-eval`` run with a plain ``llamacpp`` row and llama.cpp speculative rows) whose
first-turn reply differs from the plain row's at token ``i``, a plain ``llama-server`` on the same GGUF and threads:

- **batched**: the prompt and the plain reply's first ``i`` tokens sent as one prompt, one token generated: the
  log-probabilities of position ``i`` come from the last row of a batched pass;
- **one token**: the prompt and the first ``i - 1`` reply tokens sent, two tokens generated: position ``i``'s
  log-probabilities come from a decoding step over one token, as plain greedy decoding computed them.

Each is llama.cpp's ``completion_probabilities`` (``n_probs`` = 2, before sampling). Where the two top tokens are a
near tie and the batched pass puts the other one first, the reply left plain decoding at a numerical tie between
llama.cpp's kernels for a batch and for one token, not by a fault of the acceptance rule. Writes ``--output`` (JSON)
and prints a table. The prompts are rebuilt as ``medusa-eval`` built them (its ``run.json``: prompt set, model, chat
template); a prompt whose length differs from the row's is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAIN = "llamacpp"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length if one is a prefix); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top_two(entry: dict[str, Any]) -> list[tuple[int, float]]:
    """``[(token id, probability)]`` of one ``completion_probabilities`` entry's most likely tokens, best first."""
    tops = entry.get("top_logprobs")
    if not isinstance(tops, list):
        raise ValueError(f"llama-server's completion_probabilities entry has no top_logprobs: {str(entry)[:200]}")
    return [(int(t["id"]), math.exp(float(t["logprob"]))) for t in tops]


def divergences(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{prompt_id, decoder, index, plain_token, other_token}`` for each first-turn speculative llama.cpp row whose
    reply differs from the plain row's."""
    plain = {r["prompt_id"]: r for r in rows if r["decoder"] == PLAIN and r["turn"] == 1}
    found = []
    for r in rows:
        if r["turn"] != 1 or not r["decoder"].startswith("llamacpp_") or r["prompt_id"] not in plain:
            continue
        base = plain[r["prompt_id"]]["tokens"]
        i = first_difference(base, r["tokens"])
        if i is not None and i < min(len(base), len(r["tokens"])):
            found.append({"prompt_id": r["prompt_id"], "decoder": r["decoder"], "index": i,
                          "plain_token": base[i], "other_token": r["tokens"][i], "prompt_tokens": r["prompt_tokens"]})
    return found


def prompt_ids(run: dict[str, Any]) -> dict[str, list[int]]:
    """The first-turn prompt ids ``medusa-eval`` decoded, by prompt id."""
    from inference.evaluation.runner import conversation_messages
    from medusa_train.config.schema import ModelConfig
    from medusa_train.loading.base import load_tokenizer_and_config
    from medusa_train.chat.prompts import encode_prompt, load_prompts

    config = run["config"]
    tokenizer, _ = load_tokenizer_and_config(ModelConfig(**config["model"]))
    prompts = load_prompts(config["prompts"], config.get("prompts_path"), num_prompts=config.get("num_prompts"))
    return {p.id: encode_prompt(tokenizer, conversation_messages(p, [p.turns[0]], [])) for p in prompts}


def measure(run_dir: Path, threads: int) -> dict[str, Any]:
    from inference.engines.llamacpp_server import LlamaServer
    from inference.evaluation.results import RESULTS_FILE, read_rows

    run = json.loads((run_dir / "run.json").read_text())
    rows = read_rows(run_dir / RESULTS_FILE)
    found = divergences(rows)
    ids = prompt_ids(run) if found else {}
    plain_rows = {r["prompt_id"]: r["tokens"] for r in rows if r["decoder"] == PLAIN and r["turn"] == 1}
    target = run["decoders"][PLAIN]["engine_model"]
    with LlamaServer(target, threads=threads, ctx_size=4096) as server:
        for d in found:
            prompt = ids[d["prompt_id"]]
            if len(prompt) != d["prompt_tokens"]:
                raise ValueError(f"{d['prompt_id']}: the rebuilt prompt has {len(prompt)} tokens, the row "
                                 f"{d['prompt_tokens']}: not the prompt medusa-eval decoded")
            reply, i = plain_rows[d["prompt_id"]], d["index"]
            batched = server.complete(prompt + reply[:i], 1, ignore_eos=True, n_probs=2)
            single = server.complete(prompt + reply[: i - 1], 2, ignore_eos=True, n_probs=2)
            if single["tokens"][0] != reply[i - 1]:
                raise ValueError(f"{d['prompt_id']}: plain llama.cpp did not repeat its own token {i - 1}")
            d["batched"], d["one_token"] = top_two(batched["probs"][0]), top_two(single["probs"][1])
    return {"run": str(run_dir), "engine": run["decoders"][PLAIN].get("engine"), "threads": threads,
            "date": datetime.now(timezone.utc).date().isoformat(), "divergences": found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a medusa-eval run with llama.cpp rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    for name in ("run.json", "results.jsonl"):
        if not (args.run / name).is_file():
            parser.error(f"--run {args.run}: no {name} there (a medusa-eval output folder)")
    record = measure(args.run, args.threads)
    print("| prompt | decoder | token | plain's | other's | batched: top-2 (p) | one token: top-2 (p) |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    for d in record["divergences"]:
        show = lambda tops: ", ".join(f"{t} ({p:.4f})" for t, p in tops)  # noqa: E731
        print(f"| {d['prompt_id']} | {d['decoder']} | {d['index']} | {d['plain_token']} | {d['other_token']} | "
              f"{show(d['batched'])} | {show(d['one_token'])} |")
    if args.output:
        from medusa_train.files.atomic import atomic_write_text

        atomic_write_text(args.output, json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
