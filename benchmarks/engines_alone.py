"""Is every decoder in medusa-eval timed alone? Plain decoding's speed in a run without and with the vLLM rows.

Two ``medusa-eval`` runs on the same prompts, one after the other: ``without`` (our decoders) and ``with`` (the same
plus ``vllm`` and ``vllm_medusa``, whose engines live in other processes for the whole run). If the engines were
computing or spinning while ours are timed, every row of ours in ``with`` would be slower than in ``without``. For
each decoder both runs have, the table gives its tokens/s in each and the ratio ``with / without`` with its 95%
paired-bootstrap interval over the prompt turns (:mod:`inference.evaluation.intervals`): an interval holding 1 means
the two runs agree within the run-to-run noise measured on these prompts.

    python benchmarks/engines_alone.py --export runs/quickstart/export --out runs/engines_alone
    python benchmarks/engines_alone.py --compare runs/engines_alone/without runs/engines_alone/with   # no decoding

Writes ``OUT/without``, ``OUT/with`` (ordinary medusa-eval folders, resumable) and ``OUT/engines_alone.md``; prints
the table. Needs vLLM's environment (``bash launch/install_vllm.sh``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from inference.evaluation.intervals import ratio_interval
from inference.evaluation.results import RESULTS_FILE, read_rows
from inference.evaluation.sweep import SUMMARY_FILE

OURS = ["vanilla", "medusa", "hf_prompt_lookup"]
ENGINES = ["vllm", "vllm_medusa"]


def run_eval(export: str, out: Path, decoders: list[str], extra: list[str]) -> None:
    command = [sys.executable, "-m", "inference.cli.evaluate", f"export_dir={export}", f"output_dir={out}",
               f"decoders=[{','.join(decoders)}]", *extra]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def compare(without: Path, with_engines: Path) -> str:
    """The Markdown table: per decoder of both runs, tokens/s in each and ``with / without`` with its interval."""
    rows = {name: read_rows(folder / RESULTS_FILE) for name, folder in (("without", without), ("with", with_engines))}
    summaries = {name: json.loads((folder / SUMMARY_FILE).read_text())
                 for name, folder in (("without", without), ("with", with_engines))}
    lines = ["| decoder | threads (without / with) | tokens/s without | tokens/s with | with / without [95%] | "
             "agree within the noise |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for decoder in summaries["without"]["decoders"]:
        if decoder not in summaries["with"]["decoders"]:
            continue
        turns = {name: {(r["prompt_id"], r["turn"]): r for r in rows[name] if r["decoder"] == decoder}
                 for name in rows}
        shared = sorted(set(turns["without"]) & set(turns["with"]))
        interval = ratio_interval([turns["with"][t]["new_tokens"] for t in shared],
                                  [turns["with"][t]["wall_time_s"] for t in shared],
                                  [turns["without"][t]["new_tokens"] for t in shared],
                                  [turns["without"][t]["wall_time_s"] for t in shared])
        a, b = summaries["without"]["decoders"][decoder], summaries["with"]["decoders"][decoder]
        lines.append(f"| {decoder} | {a.get('compute_threads')} / {b.get('compute_threads')} | "
                     f"{a['tokens_per_second']:.2f} | {b['tokens_per_second']:.2f} | {interval.describe(spec='.3f')} | "
                     f"{'no' if interval.separated else 'yes'} |")
    engines = [f"{name}: {m['tokens_per_second']:.2f} tokens/s on {m.get('compute_threads')} threads, τ "
               f"{m['mean_accepted_tokens']:.2f}" for name, m in summaries["with"]["decoders"].items()
               if name in ENGINES]
    load = {name: s.get("load_average") for name, s in summaries.items()}
    return "\n".join([*lines, "", "Engines in the `with` run: " + ("; ".join(engines) or "none") + ".",
                      f"Load average (1, 5, 15 min) before and after the timed decoding: {json.dumps(load)}."])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", help="the export folder both runs evaluate")
    parser.add_argument("--out", type=Path, default=Path("runs/engines_alone"))
    parser.add_argument("--prompts", default="spec_bench")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("WITHOUT", "WITH"),
                        help="compare two finished runs instead of running them")
    args = parser.parse_args(argv)
    if args.compare:
        without, with_engines = args.compare
    else:
        if not args.export:
            parser.error("--export is required unless --compare is given")
        extra = [f"prompts={args.prompts}", f"per_category={args.per_category}", "max_turns=1",
                 f"max_new_tokens={args.max_new_tokens}", f"dtype={args.dtype}", "plots=false", "progress=false"]
        without, with_engines = args.out / "without", args.out / "with"
        run_eval(args.export, without, OURS, extra)
        run_eval(args.export, with_engines, OURS + ENGINES, extra)
    table = compare(without, with_engines)
    if not args.compare:
        (args.out / "engines_alone.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
