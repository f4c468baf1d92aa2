"""Numbers from ``results.jsonl`` rows: ``summary.json`` (fields below) and ``summary.md`` (a table per category
and overall).

Definitions, over the (prompt, turn) pairs every decoder of the run answered:

- tokens_per_second: all new tokens / all wall time (prefill included) of the decoder.
- speedup: its tokens_per_second / its baseline's over the same pairs, same run; ``baseline`` names that decoder:
  ``vanilla`` (plain decoding in our decoder) for ours and for an engine's plain row (``vllm``, ``llamacpp``), and
  the engine's plain row for that engine's speculative rows when it ran (:func:`inference.registry.baseline_of`), so
  ``vllm_draft``'s speedup is over plain vLLM, as a vLLM user measures it.
- speedup_interval: the speedup's 95% paired-bootstrap interval over the prompt turns
  (:mod:`inference.evaluation.intervals`), with ``separated``: whether it excludes 1 (faster or slower than the
  baseline beyond the measured noise).
- mean_accepted_tokens (τ): decoding-pass tokens / decoding passes summed over the rows
  (:func:`inference.decoders.base.aggregate_mean_accepted_tokens`; the prefill's token and pass are apart), so plain
  decoding scores exactly 1.0.
- exact_match_vs_greedy: share of pairs whose tokens equal its baseline's exactly; only meaningful when the
  baseline is greedy (``temperature == 0``), None otherwise.

Values that cannot be computed (no decoding pass, no wall time) are None in JSON.

Tree decoders (``medusa``, with Medusa or Hydra heads) also report where a step's time goes
(:func:`step_times`, in ``summary_details.json`` and ``summary.md``): drafting (the heads filling the tree) and
verification (the tree pass, acceptance and cache compaction), each in milliseconds per decoding pass.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from inference.decoders.base import aggregate_mean_accepted_tokens
from inference.evaluation.eval_config import BASELINE
from inference.evaluation.intervals import bounds_text, paired_interval
from inference.evaluation.recommend import recommendation_markdown
from inference.evaluation.results import row_result
from inference.registry import baseline_of

OVERALL = "overall"
METRICS = ("tokens_per_second", "speedup", "speedup_interval", "baseline", "mean_accepted_tokens",
           "exact_match_vs_greedy", "new_tokens", "wall_time_s")


def decoder_order(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Decoder names in order of first appearance."""
    return list(dict.fromkeys(r["decoder"] for r in rows))


def complete_units(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    """(prompt_id, turn) -> {decoder: row}, for the pairs every decoder of ``rows`` answered (run order kept)."""
    names = decoder_order(rows)
    units: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        units.setdefault((str(r["prompt_id"]), int(r["turn"])), {})[r["decoder"]] = r
    return {k: v for k, v in units.items() if len(v) == len(names)}


def _none_if_nan(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def decoder_metrics(
    units: Sequence[dict[str, dict[str, Any]]], greedy: bool, baseline: str = BASELINE
) -> dict[str, dict[str, Any]]:
    """The per-decoder fields of ``summary.json`` over ``units`` (each {decoder: row} for one prompt turn).

    Args:
        units: complete pairs (every decoder present).
        greedy: the baseline decoded greedily (exact match is None otherwise).
        baseline: the decoder speedup and exact match compare against; :data:`BASELINE` (``vanilla``): each
            decoder's own engine's plain row where it ran (:func:`inference.registry.baseline_of`); another name:
            that decoder for every row.

    Returns:
        ``{decoder: {"tokens_per_second", "speedup", "speedup_interval", "baseline", "mean_accepted_tokens",
        "exact_match_vs_greedy", "new_tokens", "wall_time_s"}}``; speedup and its interval None without the
        baseline or when its speed is 0.
    """
    if not units:
        return {}
    names = list(units[0])
    refs = {name: baseline_of(name, names) if baseline == BASELINE else baseline for name in names}
    table: dict[str, dict[str, Any]] = {}
    for name in names:
        rows = [u[name] for u in units]
        new_tokens = sum(int(r["new_tokens"]) for r in rows)
        wall = sum(float(r["wall_time_s"]) for r in rows)
        ref = refs[name]
        exact = None
        if greedy and ref in names:
            exact = sum(u[name]["tokens"] == u[ref]["tokens"] for u in units) / len(units)
        table[name] = {
            "tokens_per_second": new_tokens / wall if wall > 0 else None,
            "speedup": None,
            "speedup_interval": None,
            "baseline": ref if ref in names else None,
            "mean_accepted_tokens": _none_if_nan(aggregate_mean_accepted_tokens([row_result(r) for r in rows])),
            "exact_match_vs_greedy": exact,
            "new_tokens": new_tokens,
            "wall_time_s": wall,
        }
    for name, metrics in table.items():
        base_tps = table.get(refs[name], {}).get("tokens_per_second")
        if base_tps and metrics["tokens_per_second"] is not None:
            metrics["speedup"] = metrics["tokens_per_second"] / base_tps
            metrics["speedup_interval"] = paired_interval(units, name, refs[name]).record()
    return table


def tables_by_category(
    rows: Sequence[dict[str, Any]], greedy: bool, baseline: str = BASELINE
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{"overall": metrics, <category>: metrics, ...}`` over the complete pairs of ``rows``, the categories in the
    order the prompt set lists them (Spec-Bench's: MT-Bench's eight, then translation, summarization, QA, math
    reasoning, RAG)."""
    units = complete_units(rows)
    by_category: dict[str, list[dict[str, dict[str, Any]]]] = {}
    for unit in units.values():
        by_category.setdefault(str(next(iter(unit.values()))["category"]), []).append(unit)
    out = {OVERALL: decoder_metrics(list(units.values()), greedy, baseline)}
    for category in by_category:  # first appearance: the prompts' order
        out[category] = decoder_metrics(by_category[category], greedy, baseline)
    return out


def step_times(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{decoder: {"draft_time_s", "verify_time_s", "draft_ms_per_step", "verify_ms_per_step"}}`` over the
    complete pairs, for the decoders whose every row times its drafting (rows without the fields are left out)."""
    rows_by: dict[str, list[dict[str, Any]]] = {}
    for unit in complete_units(rows).values():
        for name, r in unit.items():
            rows_by.setdefault(name, []).append(r)
    out: dict[str, dict[str, float]] = {}
    for name, mine in rows_by.items():
        if any(r.get("draft_time_s") is None or r.get("verify_time_s") is None for r in mine):
            continue
        draft = sum(float(r["draft_time_s"]) for r in mine)
        verify = sum(float(r["verify_time_s"]) for r in mine)
        passes = sum(int(r["forward_passes"]) for r in mine)
        out[name] = {"draft_time_s": draft, "verify_time_s": verify,
                     "draft_ms_per_step": 1000.0 * draft / passes if passes else None,
                     "verify_ms_per_step": 1000.0 * verify / passes if passes else None}
    return out


def step_times_markdown(times: dict[str, dict[str, float]]) -> str:
    """A Markdown table of :func:`step_times`: a row per tree decoder."""
    lines = ["| decoder | draft ms/step | verify ms/step | draft (s) | verify (s) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, t in times.items():
        lines.append(f"| {name} | {_fmt(t['draft_ms_per_step'], '.2f')} | {_fmt(t['verify_ms_per_step'], '.2f')} | "
                     f"{t['draft_time_s']:.2f} | {t['verify_time_s']:.2f} |")
    return "\n".join(lines)


def accepted_length_histogram(rows: Sequence[dict[str, Any]]) -> dict[str, dict[int, int]]:
    """{decoder: {tokens kept by one decoding pass: number of passes}} over the complete pairs."""
    hist: dict[str, Counter] = {}
    for unit in complete_units(rows).values():
        for name, r in unit.items():
            hist.setdefault(name, Counter()).update(int(a) for a in r["accepted_lengths"])
    return {name: dict(sorted(c.items())) for name, c in hist.items()}


def summarize(
    rows: Sequence[dict[str, Any]], greedy: bool, model: str, device: str, dtype: str, max_new_tokens: int,
    baseline: str = BASELINE, runtime: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``summary.json``'s fields::

        {"model", "device", "dtype", "prompts", "max_new_tokens",
         "decoders": {name: {"tokens_per_second", "speedup", "mean_accepted_tokens", "exact_match_vs_greedy",
                             "new_tokens", "wall_time_s"}}}

    then, when given, ``runtime``'s entries (``precision``: the dtype decision, its reason and the CPU's ISA flags;
    ``cpu_kernels``: the linear kernels every decoder ran on; ``divergences``: greedy runs' replies that left
    vanilla's, explained by :func:`inference.evaluation.divergence.explain_divergences`). ``prompts`` counts the
    distinct prompts with at least one complete turn.
    """
    units = complete_units(rows)
    return {
        "model": model,
        "device": device,
        "dtype": dtype,
        "prompts": len({pid for pid, _ in units}),
        "max_new_tokens": max_new_tokens,
        "decoders": decoder_metrics(list(units.values()), greedy, baseline),
        **(runtime or {}),
    }


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _interval(m: dict[str, Any]) -> str:
    i = m.get("speedup_interval")
    return "n/a" if not i or i["low"] is None else bounds_text(i)


def markdown_table(metrics: dict[str, dict[str, Any]]) -> str:
    """One Markdown table: a row per decoder, the speedup with its 95% interval."""
    lines = ["| decoder | tokens/s | speedup | over | 95% interval | mean accepted tokens | exact match | new tokens | "
             "wall time (s) |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in metrics.items():
        lines.append(f"| {name} | {_fmt(m['tokens_per_second'], '.2f')} | {_fmt(m['speedup'], '.2f')}x | "
                     f"{m.get('baseline') or 'n/a'} | {_interval(m)} | "
                     f"{_fmt(m['mean_accepted_tokens'], '.2f')} | {_fmt(m['exact_match_vs_greedy'], '.2f')} | "
                     f"{m['new_tokens']} | {m['wall_time_s']:.1f} |")
    return "\n".join(lines)


def divergence_lines(divergences: dict[str, Any] | None) -> list[str]:
    """summary.md's account of the replies that left vanilla's (greedy runs), one line per decoder that diverged."""
    if not divergences:
        return []
    threshold = divergences.get("threshold")
    noise = divergences.get("rounding_noise") or {}
    lines = []
    for name, d in divergences["decoders"].items():
        if not d["diverged"]:
            continue
        text = f"{name}: {d['diverged']} of {d['replies']} replies left vanilla's"
        if threshold is not None:
            text += (f", {d['near_ties']} at a near-tie (vanilla's top-2 logit gap <= {threshold:.3g}, the largest "
                     f"gap change measured between 1-token and k-token passes, k = {noise.get('ks')}, at "
                     f"{noise.get('positions')} positions)")
        if d["not_near_ties"]:
            where = ", ".join(f"prompt {x['prompt_id']} turn {x['turn']} token {x['position']} (gap "
                              f"{x['vanilla_gap']:.3g})" for x in d["not_near_ties"])
            text += f"; NOT near-ties: {where}"
        if d["unexplained"]:
            text += f"; {d['unexplained']} without a recorded gap or noise measurement"
        lines.append(text + ".")
    return lines


def leaderboard_markdown(by_category: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Spec-Bench's leaderboard layout: a row per decoder, its speedup in each category, its mean accepted tokens
    (τ) over all prompts, and the overall speedup with its 95% interval last."""
    categories = [c for c in by_category if c != OVERALL]
    overall = by_category.get(OVERALL, {})
    lines = ["| decoder | " + " | ".join(categories) + " | τ | overall |",
             "| --- | " + " | ".join("---:" for _ in categories) + " | ---: | ---: |"]
    for name, m in overall.items():
        cells = [f"{_fmt(by_category[c].get(name, {}).get('speedup'), '.2f')}x" for c in categories]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(m['mean_accepted_tokens'], '.2f')} | "
                     f"{_fmt(m['speedup'], '.2f')}x {_interval(m)} |")
    return "\n".join(lines)


def summary_markdown(summary: dict[str, Any], by_category: dict[str, dict[str, dict[str, Any]]],
                     command: str | None = None, commit: str | None = None,
                     times: dict[str, dict[str, float]] | None = None) -> str:
    """``summary.md``: the run's header, the overall table, the tree decoders' step times (when given), the
    per-category leaderboard (several categories), one table per category, then the recommendation (when
    ``summary["recommendation"]`` holds one)."""
    precision, kernels = summary.get("precision"), summary.get("cpu_kernels")
    head = [f"# medusa-eval: {summary['model']}", "",
            f"{summary['prompts']} prompts, max_new_tokens {summary['max_new_tokens']}, {summary['dtype']} on "
            f"{summary['device']}" + (f", commit {commit}" if commit else "") + "."]
    if precision:
        head.append(f"dtype {precision['dtype']} ({precision['requested']}): {precision['reason']}; CPU flags: "
                    f"{', '.join(precision['cpu']['flags']) or 'none recorded'}.")
    if kernels:
        head.append(f"Linear kernels: {kernels['kernels']} ({kernels['requested']}), the same for every decoder.")
    head.append("Speedup: tokens/s over the baseline's (the `over` column: vanilla, or an engine's own plain row "
                "for its speculative rows) on the same prompts in the same run; mean accepted tokens: new tokens per "
                "target forward pass after the prefill; exact match: share of replies identical to the baseline's "
                "(greedy runs only).")
    head += divergence_lines(summary.get("divergences"))
    skipped = summary.get("skipped_prompts") or []
    if skipped:
        head += ["", f"Left out, not fitting the model's context with max_new_tokens {summary['max_new_tokens']}: "
                 + ", ".join(f"prompt {s['prompt_id']} turn {s['turn']} ({s['prompt_tokens']} tokens)"
                             for s in skipped) + "."]
    if command:
        head += ["", f"Command: `{command}`"]
    parts = ["\n".join(head), f"## {OVERALL}\n\n{markdown_table(by_category.get(OVERALL, {}))}"]
    if times:
        parts.append(f"## drafting and verification\n\n{step_times_markdown(times)}")
    if len(by_category) > 2:  # overall and two categories or more
        parts.append(f"## by category (speedup over each row's baseline)\n\n{leaderboard_markdown(by_category)}")
    parts += [f"## {cat}\n\n{markdown_table(m)}" for cat, m in by_category.items() if cat != OVERALL]
    if summary.get("recommendation"):
        machine = f"{summary['device']}, {summary['dtype']}"
        if precision:
            machine += f", CPU flags {', '.join(precision['cpu']['flags']) or 'none recorded'}"
        parts.append(recommendation_markdown(summary["recommendation"], machine))
    return "\n\n".join(parts) + "\n"


__all__ = [
    "METRICS",
    "OVERALL",
    "accepted_length_histogram",
    "complete_units",
    "decoder_metrics",
    "decoder_order",
    "divergence_lines",
    "leaderboard_markdown",
    "markdown_table",
    "step_times",
    "step_times_markdown",
    "summarize",
    "summary_markdown",
    "tables_by_category",
]
