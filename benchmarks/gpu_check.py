"""The one table at the end of ``launch/gpu_check.sh``, from what the check left in its folder.

    python benchmarks/gpu_check.py report runs/gpu_check                 # prints the table of a finished check

It reads ``steps.tsv`` (one line per step: name, status, seconds, log), the ``medusa-eval`` summaries
(``eval/summary.json``: the Medusa heads; ``eval_eagle3/summary.json``: the EAGLE-3 drafter) and the
``benchmarks/serve_vllm.py`` summaries (``vllm.json``, ``vllm_eagle3.json``), whichever exist.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (file, label suffix) of each summary in a check's folder: the Medusa heads' rows, then the EAGLE-3 drafter's
EVAL_SUMMARIES = (("eval/summary.json", ""), ("eval_eagle3/summary.json", " [eagle3]"))
VLLM_SUMMARIES = (("vllm.json", ""), ("vllm_eagle3.json", " [eagle3]"))


def _fmt(value: object, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(out: Path) -> str:
    """The check's one table: a row per step (status, seconds, log), then a row per decoder measured (ours by
    ``medusa-eval``, vLLM's by ``serve_vllm.py``, one per batch size) with tokens/s, speedup, mean accepted tokens
    and exact match (ours: against greedy decoding; vLLM's: against plain vLLM). Rows of the EAGLE-3 drafter's
    summaries end in ``[eagle3]``."""
    lines = ["| step / decoder | status | seconds | tokens/s | speedup | mean accepted tokens | exact match | where |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    steps = out / "steps.tsv"
    for row in (steps.read_text().splitlines() if steps.is_file() else []):
        name, status, seconds, log = (row.split("\t") + ["", "", ""])[:4]
        lines.append(f"| {name} | {status} | {seconds} | | | | | {log} |")

    def metrics(name: str, where: str, m: dict, exact: str) -> str:
        return (f"| {name} | measured | {_fmt(m.get('wall_time_s'), '.1f')} | {_fmt(m['tokens_per_second'], '.1f')} | "
                f"{_fmt(m['speedup'], '.2f')}x | {_fmt(m['mean_accepted_tokens'], '.2f')} | "
                f"{_fmt(m[exact], '.2f')} | {where} |")

    for file, label in EVAL_SUMMARIES:
        if (out / file).is_file():
            data = json.loads((out / file).read_text())
            for name, m in data["decoders"].items():
                lines.append(metrics(name + label, f"medusa-eval, {data['dtype']} on {data['device']}", m,
                                     "exact_match_vs_greedy"))
    for file, label in VLLM_SUMMARIES:
        if (out / file).is_file():
            data = json.loads((out / file).read_text())
            for batch, runs in data["batches"].items():
                for name, m in runs.items():
                    lines.append(metrics(name + label, f"{data['engine']}, {data['dtype']}, batch {batch}", m,
                                         "exact_match_vs_vllm"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("report", help="print the table of a check's folder").add_argument("out")
    args = parser.parse_args(argv)
    print(report(Path(args.out)))


if __name__ == "__main__":
    main()
