"""A ``medusa-eval`` run's rows measured against plain llama.cpp: every decoder's tokens/s, speedup over ``llamacpp``
(with its 95% paired-bootstrap interval over the prompt turns), mean accepted tokens (τ; llama.cpp's rows: the
acceptance its server counted) and the share of replies identical to ``llamacpp``'s; then whether plain llama.cpp is
faster than our fastest decoder on this machine.

    medusa-eval export_dir=runs/quickstart/eagle3/export output_dir=runs/quickstart/eagle3/eval-llamacpp \\
        prompts=mt_bench per_category=1 max_turns=1 max_new_tokens=64 \\
        decoders=[vanilla,medusa,llamacpp,llamacpp_eagle3]
    python benchmarks/llamacpp_table.py runs/quickstart/eagle3/eval-llamacpp

The rows are medusa-eval's: interleaved per prompt, greedy, the same prompts and token budget, each decoder timed
alone on the same threads (the llama.cpp server is stopped between its turns). Reads ``results.jsonl`` only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from inference.evaluation.results import RESULTS_FILE, read_rows
from inference.evaluation.summary import complete_units, decoder_metrics, markdown_table

PLAIN = "llamacpp"
BASELINE = "vanilla"
ENGINES = ("llamacpp", "llamacpp_eagle3", "vllm", "vllm_medusa", "vllm_eagle3")  # not our decoders


def table(eval_dir: str | Path) -> str:
    """The Markdown table and the verdict line for ``eval_dir``.

    Raises:
        ValueError: the run has no ``llamacpp`` row, or no turn every decoder answered.
    """
    units = list(complete_units(read_rows(Path(eval_dir) / RESULTS_FILE)).values())
    if not units or PLAIN not in units[0]:
        raise ValueError(f"{eval_dir}: no prompt turn with a {PLAIN} row answered by every decoder; run medusa-eval "
                         f"with decoders=[vanilla,...,{PLAIN},llamacpp_eagle3]")
    over_plain = decoder_metrics(units, greedy=True, baseline=PLAIN)
    lines = [f"Speedup and exact match over `{PLAIN}` (plain llama.cpp), {len(units)} prompt turns.", "",
             markdown_table(over_plain)]
    ours = {name: m for name, m in over_plain.items() if name not in ENGINES and m["tokens_per_second"]}
    if ours:
        best = max(ours, key=lambda name: ours[name]["tokens_per_second"])
        ratio = over_plain[PLAIN]["tokens_per_second"] / ours[best]["tokens_per_second"]
        verdict = "faster" if ratio > 1 else "not faster"
        lines += ["", f"Plain llama.cpp is {verdict} than our fastest decoder here: {ratio:.2f}x `{best}`'s tokens/s "
                      f"(`{best}`'s row above: its speedup over `{PLAIN}` with its interval)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("eval_dir", help="a medusa-eval output folder with llamacpp rows")
    print(table(parser.parse_args(argv).eval_dir))


if __name__ == "__main__":
    main()
