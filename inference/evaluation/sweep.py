"""One table from many evaluation runs (a Hydra multirun, or any run folders).

Each run folder holds ``summary.json`` and ``run.json`` (its overrides). The table has one row per run and decoder
other than the baseline (one row per run when a single decoder is swept), with a column per override that varies
between the runs; overrides shared by every run are listed above it. ``medusa-eval -m ...`` writes
``sweep.md`` and ``sweep.jsonl`` into the sweep folder when the multirun ends (:class:`SweepTableCallback`);
``python -m inference.evaluation.sweep RUN_OR_SWEEP_DIR...`` combines any folders by hand.

A sweep folder that held files other than a medusa-eval sweep's when the multirun started (:func:`foreign_entries`)
gets no table (it is printed, with a warning): each job writes only into its own numbered folder, checked as one
run (:mod:`inference.evaluation.eval_folder`), and the table never replaces someone else's ``sweep.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from inference.evaluation.eval_config import BASELINE
from inference.evaluation.eval_folder import RUN_FILE, is_our_run
from inference.evaluation.recommend import Candidate, candidates_from_rows, recommend, recommendation_markdown
from inference.evaluation.results import RESULTS_FILE, read_rows
from medusa_train.files.atomic import atomic_write_text

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
SWEEP_MD = "sweep.md"
SWEEP_JSONL = "sweep.jsonl"
MULTIRUN_FILE = "multirun.yaml"  # Hydra's record of the sweep


def _natural(path: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(folders: Sequence[str | Path]) -> list[Path]:
    """Run folders (those holding summary.json): each folder itself, or its subfolders when it is a sweep folder.

    Raises:
        FileNotFoundError: a folder does not exist or holds no run.
    """
    runs: list[Path] = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder")
        if (folder / SUMMARY_FILE).is_file():
            runs.append(folder)
            continue
        found = sorted((p.parent for p in folder.glob(f"*/{SUMMARY_FILE}")), key=_natural)
        unfinished = sorted((p.name for p in folder.iterdir() if p.name.isdigit() and p.is_dir()
                             and not (p / SUMMARY_FILE).is_file()), key=int)
        if found and unfinished:
            log.warning("%s: runs %s have not finished (no %s) and are left out of the table; rerun the sweep's "
                        "command to finish them", folder, ", ".join(unfinished), SUMMARY_FILE)
        if not found:
            raise FileNotFoundError(
                f"{folder} holds no finished run ({SUMMARY_FILE} in it or in its numbered subfolders): pass a "
                "medusa-eval run or sweep folder whose runs finished, or finish the sweep first (the same "
                "`medusa-eval -m ...` command resumes it)")
        runs += found
    return runs


def run_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides of a run (``run.json``'s ``overrides``, else Hydra's ``.hydra/overrides.yaml``)."""
    info = run_dir / RUN_FILE
    if info.is_file():
        overrides = json.loads(info.read_text()).get("overrides")
        if overrides is not None:
            return list(overrides)
    hydra_file = run_dir / ".hydra" / "overrides.yaml"
    if hydra_file.is_file():
        from omegaconf import OmegaConf

        return [str(o) for o in OmegaConf.load(hydra_file)]
    return []


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def sweep_rows(run_dirs: Sequence[str | Path], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Rows of the combined table: ``{"run", "overrides": {key: value}, "decoder", <summary metrics>,
    "baseline_tokens_per_second"}``; the baseline itself only for a run in which it is the only decoder."""
    rows = []
    for run_dir in map(Path, run_dirs):
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        decoders: dict[str, dict[str, Any]] = summary["decoders"]
        base_tps = decoders.get(baseline, {}).get("tokens_per_second")
        overrides = dict(_split(o) for o in run_overrides(run_dir))
        names = [n for n in decoders if n != baseline] or list(decoders)
        for name in names:
            rows.append({"run": str(run_dir), "overrides": overrides, "decoder": name, **decoders[name],
                         "baseline_tokens_per_second": base_tps, "prompts": summary.get("prompts")})
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def varying_overrides(overrides: Sequence[dict[str, str]]) -> tuple[list[str], list[str]]:
    """``(every key, the keys whose value differs between runs)`` of the runs' overrides, in first-seen order."""
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    return keys, [k for k in keys if len({o.get(k) for o in overrides}) > 1]


def sweep_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The combined table in Markdown, overrides that vary as columns and the shared ones above."""
    keys, varying = varying_overrides([r["overrides"] for r in rows])
    shared = [f"{k}={rows[0]['overrides'][k]}" for k in keys if k not in varying]
    lines = [f"Shared overrides: `{' '.join(shared)}`", ""] if shared else []
    lines += ["| run | " + " | ".join(varying + ["decoder", "speedup", "mean accepted tokens", "exact match",
                                                 "tokens/s", "vanilla tokens/s", "new tokens"]) + " |",
              "| --- | " + " | ".join(["---"] * (len(varying) + 1) + ["---:"] * 6) + " |"]
    for r in rows:
        cells = [Path(r["run"]).name or r["run"]] + [r["overrides"].get(k, "") for k in varying] + [
            r["decoder"], _fmt(r["speedup"], ".2f") + "x", _fmt(r["mean_accepted_tokens"], ".2f"),
            _fmt(r["exact_match_vs_greedy"], ".2f"), _fmt(r["tokens_per_second"], ".2f"),
            _fmt(r["baseline_tokens_per_second"], ".2f"), str(r["new_tokens"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sweep_candidates(run_dirs: Sequence[str | Path], baseline: str = BASELINE) -> list[Candidate]:
    """Every decoder of every run as a deployment candidate (:mod:`inference.evaluation.recommend`), each scored
    against its own run's baseline, labelled with the run's varying overrides; the baseline once."""
    runs = [Path(d) for d in run_dirs]
    overrides = {d: dict(_split(o) for o in run_overrides(d)) for d in runs}
    _, varying = varying_overrides(list(overrides.values()))
    out: list[Candidate] = []
    for run_dir in runs:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())["decoders"]
        config = json.loads((run_dir / RUN_FILE).read_text()).get("config", {}) if (run_dir / RUN_FILE).is_file() \
            else {}
        for c in candidates_from_rows(read_rows(run_dir / RESULTS_FILE), baseline, config.get("decoder") or {},
                                      taus={n: m.get("mean_accepted_tokens") for n, m in summary.items()},
                                      exact={n: m.get("exact_match_vs_greedy") for n, m in summary.items()}):
            if c.decoder != baseline:
                mine = [k for k in varying if concerns(k, c.decoder)]
                label = ", ".join(f"{k}={overrides[run_dir].get(k, '')}" for k in mine)
                varied = {k: overrides[run_dir][k] for k in mine if k in overrides[run_dir]}
                out.append(dataclasses.replace(c, label=f"{c.label} ({label})" if label else c.label,
                                               settings={**c.settings, **varied}))
            elif not any(o.decoder == baseline for o in out):
                out.append(dataclasses.replace(c, label=baseline))
    return out


def concerns(key: str, decoder: str) -> bool:
    """Whether the override ``key`` can change ``decoder``: any key but another decoder's own settings
    (``decoder.<other>.<field>``), so that ``llamacpp`` is not labelled with ``decoder.llamacpp_eagle3.draft_max``."""
    parts = key.split(".")
    return not (len(parts) >= 3 and parts[0] == "decoder" and parts[1] != decoder)


def write_sweep(out_dir: str | Path, run_dirs: Sequence[str | Path]) -> tuple[Path, list[dict[str, Any]]]:
    """Write ``sweep.md`` (the table, then what to deploy across the runs: :func:`sweep_candidates`,
    :func:`~inference.evaluation.recommend.recommend`) and ``sweep.jsonl`` (one JSON row per table row) into
    ``out_dir``.

    Returns:
        ``(path of sweep.md, rows)``.
    """
    out = Path(out_dir)
    rows = sweep_rows(run_dirs)
    first = json.loads((Path(run_dirs[0]) / SUMMARY_FILE).read_text())
    machine = f"{first.get('device')}, {first.get('dtype')}"
    try:
        advice = recommendation_markdown(recommend(sweep_candidates(run_dirs)), machine)
    except (OSError, ValueError) as e:  # runs without their results.jsonl rows (copied summaries, older runs)
        advice = f"## Recommendation\n\nNone: {e}"
    text = sweep_markdown(rows) + "\n" + advice
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / SWEEP_JSONL, "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(out / SWEEP_MD, text + "\n")
    return out / SWEEP_MD, rows


def foreign_entries(sweep_dir: Path) -> list[str]:
    """Entries of ``sweep_dir`` that a medusa-eval sweep did not write: anything but Hydra's ``multirun.yaml``, the
    numbered job folders and the table, or a table without any numbered run of ours beside it."""
    if not sweep_dir.is_dir():
        return []
    entries = set(os.listdir(sweep_dir)) - {MULTIRUN_FILE}
    jobs = {e for e in entries if e.isdigit() and (sweep_dir / e).is_dir()}
    tables = entries & {SWEEP_MD, SWEEP_JSONL}
    other = sorted(entries - jobs - tables)
    if other:
        return other
    return sorted(tables) if tables and not any(is_our_run(sweep_dir / job) for job in jobs) else []


class SweepTableCallback(Callback):
    """Hydra callback: when a multirun ends, combine its runs into ``sweep.md`` / ``sweep.jsonl`` and print it (only
    printed when the sweep folder held other files at the start, see the module docstring)."""

    def __init__(self) -> None:
        self.foreign: list[str] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.foreign = foreign_entries(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = [p.parent for p in sorted(sweep_dir.glob(f"*/{SUMMARY_FILE}"), key=_natural)]
        if not runs:
            return
        if self.foreign:
            shown = ", ".join(self.foreign[:5]) + (f" and {len(self.foreign) - 5} more" if len(self.foreign) > 5
                                                   else "")
            log.warning("output_dir %s held files that are not a medusa-eval sweep (%s): %s and %s are not written "
                        "there; write them elsewhere with `python -m inference.evaluation.sweep %s --out NEW_DIR`",
                        sweep_dir, shown, SWEEP_MD, SWEEP_JSONL, sweep_dir)
            print(f"\nsweep of {len(runs)} runs\n\n{sweep_markdown(sweep_rows(runs))}")
            return
        path, _ = write_sweep(sweep_dir, runs)
        print(f"\nsweep of {len(runs)} runs -> {path}\n\n{path.read_text()}")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m inference.evaluation.sweep DIR... [--out DIR]``: combine run or sweep folders into one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="run folders, or sweep folders holding numbered runs")
    parser.add_argument("--out", default=None, help="where sweep.md/sweep.jsonl go (default: the first folder)")
    args = parser.parse_args(argv)
    out = Path(args.out or args.folders[0])
    try:
        runs = find_runs(args.folders)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file: give a folder for {SWEEP_MD} and {SWEEP_JSONL}")
        foreign = [] if is_our_run(out) else foreign_entries(out)  # a run folder of ours may hold the table
        if foreign:
            raise ValueError(f"--out {out} holds files that are not a medusa-eval sweep ({', '.join(foreign[:5])}): "
                             f"{SWEEP_MD} and {SWEEP_JSONL} are written only into a new folder or a sweep folder of "
                             "ours; give another --out")
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: {e}\n")
    path, _ = write_sweep(out, runs)
    print(path.read_text())


if __name__ == "__main__":
    main()


__all__ = ["SweepTableCallback", "find_runs", "foreign_entries", "run_overrides", "sweep_candidates", "sweep_markdown",
           "sweep_rows", "write_sweep"]
