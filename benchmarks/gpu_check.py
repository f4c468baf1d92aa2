"""Helpers of ``launch/gpu_check.sh``: the HF folder vLLM loads for an export's base, and the one table at the end.

    python benchmarks/gpu_check.py base runs/gpu_check/single/export     # prints the base's HF folder
    python benchmarks/gpu_check.py report runs/gpu_check                 # prints the table of a finished check

The report (one table) reads what the script left in its folder: ``steps.tsv`` (one line per step: name, status, seconds, log),
``eval/summary.json`` (``medusa-eval``) and ``vllm.json`` (``benchmarks/serve_vllm.py``), whichever exist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO_ROOT))


def base_folder(export: str) -> str:
    """The HF folder (or Hub id) of the base model recorded in ``export`` (a GGUF base converted once)."""
    from medusa_train.export import read_export_config
    from medusa_train.loading.base import engine_model_path
    from medusa_train.loading.medusa import model_config_for_export, resolve_export_base

    cfg = resolve_export_base(export, model_config_for_export(read_export_config(export)))
    return engine_model_path(cfg)


def _fmt(value: object, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def report(out: Path) -> str:
    """The check's one table: a row per step (status, seconds, log), then a row per decoder measured (ours by
    ``medusa-eval``, vLLM's by ``serve_vllm.py``) with tokens/s, speedup, mean accepted tokens and exact match."""
    lines = ["| step / decoder | status | seconds | tokens/s | speedup | mean accepted tokens | exact match | where |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    steps = out / "steps.tsv"
    for row in (steps.read_text().splitlines() if steps.is_file() else []):
        name, status, seconds, log = (row.split("\t") + ["", "", ""])[:4]
        lines.append(f"| {name} | {status} | {seconds} | | | | | {log} |")

    def metrics(name: str, where: str, m: dict) -> str:
        return (f"| {name} | measured | {_fmt(m.get('wall_time_s'), '.1f')} | {_fmt(m['tokens_per_second'], '.1f')} | "
                f"{_fmt(m['speedup'], '.2f')}x | {_fmt(m['mean_accepted_tokens'], '.2f')} | "
                f"{_fmt(m['exact_match_vs_greedy'], '.2f')} | {where} |")

    summary = out / "eval" / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        for name, m in data["decoders"].items():
            lines.append(metrics(name, f"medusa-eval, {data['dtype']} on {data['device']}", m))
    vllm = out / "vllm.json"
    if vllm.is_file():
        data = json.loads(vllm.read_text())
        for name, m in data["decoders"].items():
            lines.append(metrics("vllm" if name == "vanilla" else "vllm_medusa", f"{data['engine']}, {data['dtype']}",
                                 m))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("base", help="print the HF folder of an export's base").add_argument("export")
    sub.add_parser("report", help="print the table of a check's folder").add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "base":
        print(base_folder(args.export))
    else:
        print(report(Path(args.out)))


if __name__ == "__main__":
    main()
