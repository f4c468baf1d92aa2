"""The composite tree decoder against its parts: heads alone (``medusa``) and prompt lookup alone
(``hf_prompt_lookup``), per task category, from one medusa-eval run per prompt set.

For each prompt set, one ``medusa-eval`` run decodes every prompt turn with ``vanilla``, ``medusa``,
``hf_prompt_lookup`` and ``composite``, taking turns per prompt (each decoder alone on the CPU). The table gives, per
category and overall: each decoder's speedup over vanilla, the composite's τ, and the composite's speed over prompt
lookup's and over the better of its two parts (the one faster overall), each with its 95% paired-bootstrap interval
over the category's turns (:mod:`inference.evaluation.intervals`); and the categories where the composite is ahead of
prompt lookup.

    python benchmarks/composite_vs_parts.py --export runs/quickstart/export --out runs/composite
    python benchmarks/composite_vs_parts.py --compare runs/composite/spec_bench runs/composite/mt_bench   # no decoding

Writes ``OUT/spec_bench`` (Spec-Bench's 13 categories, two first turns each) and ``OUT/mt_bench`` (MT-Bench's 80
first turns): ordinary, resumable medusa-eval folders; and ``OUT/composite_vs_parts.md``; prints the tables.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference.evaluation.intervals import bounds_text, paired_interval
from inference.evaluation.results import RESULTS_FILE, read_rows
from inference.evaluation.summary import complete_units

DECODERS = ["vanilla", "medusa", "hf_prompt_lookup", "composite"]
PARTS = ("medusa", "hf_prompt_lookup")
PROMPT_SETS = {"spec_bench": ["prompts=spec_bench", "per_category=2"], "mt_bench": ["prompts=mt_bench",
                                                                                   "per_category=10"]}


def run_eval(export: str, out: Path, extra: Sequence[str]) -> None:
    command = [sys.executable, "-m", "inference.cli.evaluate", f"export_dir={export}", f"output_dir={out}",
               f"decoders=[{','.join(DECODERS)}]", "max_turns=1", *extra]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def _ratio(units: Sequence[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    return paired_interval(units, a, b).record()


def compare(folder: Path) -> str:
    """The table of one medusa-eval folder (see the module docstring)."""
    rows = [r for r in read_rows(folder / RESULTS_FILE) if r["decoder"] in DECODERS]
    units = complete_units(rows)
    if not units or set(next(iter(units.values()))) != set(DECODERS):
        raise SystemExit(f"{folder}: no prompt turn answered by all of {DECODERS}; run medusa-eval with them")
    by_category: dict[str, list[dict[str, Any]]] = {}
    for unit in units.values():
        by_category.setdefault(unit["vanilla"]["category"], []).append(unit)
    overall = list(units.values())
    better = max(PARTS, key=lambda name: _ratio(overall, name, "vanilla")["estimate"])
    lines = [f"**{folder}**: {len(overall)} prompt turns, {len(by_category)} categories; the better part overall: "
             f"`{better}`.", "",
             "| category | turns | medusa | hf_prompt_lookup | composite | τ composite | composite / prompt lookup "
             f"| composite / {better} |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ahead = []
    for category, group in [*by_category.items(), ("overall", overall)]:
        speed = {name: _ratio(group, name, "vanilla")["estimate"] for name in DECODERS[1:]}
        tau = (sum(sum(u["composite"]["accepted_lengths"]) for u in group)
               / max(1, sum(u["composite"]["forward_passes"] for u in group)))
        over_lookup, over_better = _ratio(group, "composite", "hf_prompt_lookup"), _ratio(group, "composite", better)
        if category != "overall" and over_lookup["estimate"] > 1:
            ahead.append(category)
        lines.append(f"| {category} | {len(group)} | {speed['medusa']:.2f}x | {speed['hf_prompt_lookup']:.2f}x | "
                     f"{speed['composite']:.2f}x | {tau:.2f} | {over_lookup['estimate']:.2f}x "
                     f"{bounds_text(over_lookup)} | {over_better['estimate']:.2f}x {bounds_text(over_better)} |")
    lines += ["", f"Ahead of prompt lookup in {len(ahead)} of {len(by_category)} categories"
              + (f" (behind in: {', '.join(c for c in by_category if c not in ahead)})." if len(ahead) < len(
                  by_category) else ".")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", help="the export folder to evaluate")
    parser.add_argument("--out", type=Path, help="where the medusa-eval folders and the table go")
    parser.add_argument("--compare", nargs="+", type=Path, help="only tabulate these medusa-eval folders")
    parser.add_argument("extra", nargs="*", help="more medusa-eval overrides (e.g. max_new_tokens=64 dtype=auto)")
    args = parser.parse_args(argv)
    if args.compare:
        folders = args.compare
    elif args.export and args.out:
        folders = []
        for name, overrides in PROMPT_SETS.items():
            run_eval(args.export, args.out / name, [*overrides, "max_new_tokens=64", *args.extra])
            folders.append(args.out / name)
    else:
        parser.error("give --export and --out (decode, then tabulate), or --compare FOLDER... (tabulate only)")
    text = "\n\n".join(compare(folder) for folder in folders)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "composite_vs_parts.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
