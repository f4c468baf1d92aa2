"""What to deploy on this machine: the fastest decoder overall and per category, with its margin and its noise.

A candidate is one decoder with its settings, in one run (a ``-m`` sweep gives one run per job). Each candidate is
scored by its speedup over the baseline of its own run (``vanilla``, plain decoding, timed interleaved with it), so
candidates from different jobs of a sweep compare through their own baselines, and plain decoding itself, in our
decoder (speedup 1) or in vLLM (the ``vllm`` row), is a candidate like any other: the answer can be "no speculation".

For each scope (overall, then each category), over the prompt turns every candidate answered:

- the candidates are ranked by speedup (ratio of summed speeds, as in ``summary.json``);
- the margin of the first over the runner-up is the ratio of their speedups, with a paired-bootstrap interval over
  the turns (:mod:`inference.evaluation.intervals`; both candidates' rows and their baselines' rows of one turn are
  resampled together), and it is "beyond the noise" when that interval excludes 1; otherwise either serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.evaluation.intervals import Interval, bootstrap_interval, bounds_text, speed_ratio

Turn = tuple[str, int]  # (prompt_id, turn)
OVERALL = "overall"


@dataclass(frozen=True)
class Candidate:
    """One decoder with its settings in one run, as measured there.

    Attributes:
        label: how tables name it (``medusa``, or ``medusa (decoder.tree.topk=3)`` in a sweep).
        decoder: the decoder's name.
        settings: its settings (``decoder.<name>`` of the run's config, plus a sweep job's overrides).
        turns: ``{(prompt_id, turn): (new tokens, wall seconds, baseline's new tokens, baseline's wall seconds)}``.
        categories: ``{(prompt_id, turn): category}``.
        mean_accepted_tokens: τ over all its rows (None where undefined).
        exact_match: share of its replies identical to the baseline's (greedy runs), else None.
    """

    label: str
    decoder: str
    settings: dict[str, Any]
    turns: dict[Turn, tuple[float, float, float, float]]
    categories: dict[Turn, str] = field(default_factory=dict)
    mean_accepted_tokens: float | None = None
    exact_match: float | None = None


def candidates_from_rows(rows: Sequence[Mapping[str, Any]], baseline: str, settings: Mapping[str, Any],
                         taus: Mapping[str, float | None] | None = None,
                         exact: Mapping[str, float | None] | None = None) -> list[Candidate]:
    """The candidates of one run's ``results.jsonl`` rows: one per decoder, over the turns it and the baseline
    answered.

    Args:
        rows: the run's rows (``prompt_id``, ``turn``, ``decoder``, ``category``, ``new_tokens``, ``wall_time_s``).
        baseline: the decoder every speedup is over (``vanilla``).
        settings: ``{decoder: its settings}`` (missing: ``{}``).
        taus, exact: ``{decoder: τ}`` and ``{decoder: exact match}`` from the run's summary, when known.

    Raises:
        ValueError: the baseline has no row.
    """
    by_decoder: dict[str, dict[Turn, Mapping[str, Any]]] = {}
    for r in rows:
        by_decoder.setdefault(str(r["decoder"]), {})[(str(r["prompt_id"]), int(r["turn"]))] = r
    if baseline not in by_decoder:
        raise ValueError(f"no row of the baseline decoder {baseline!r}: a recommendation compares every decoder "
                         f"with it; add {baseline} to decoders")
    base = by_decoder[baseline]
    out = []
    for name, mine in by_decoder.items():
        shared = [t for t in mine if t in base]
        out.append(Candidate(
            label=name, decoder=name, settings=dict(settings.get(name) or {}),
            turns={t: (float(mine[t]["new_tokens"]), float(mine[t]["wall_time_s"]), float(base[t]["new_tokens"]),
                       float(base[t]["wall_time_s"])) for t in shared},
            categories={t: str(mine[t].get("category", "")) for t in shared},
            mean_accepted_tokens=(taus or {}).get(name), exact_match=(exact or {}).get(name)))
    return out


def _columns(candidate: Candidate, turns: Sequence[Turn]) -> torch.Tensor:
    return torch.tensor([candidate.turns[t] for t in turns], dtype=torch.float64).T  # [4, turns]


def speedup(candidate: Candidate, turns: Sequence[Turn]) -> float:
    """The candidate's speedup over its baseline on ``turns`` (ratio of summed speeds)."""
    return float(speed_ratio(_columns(candidate, turns).sum(dim=1)))


def _speedup_over_speedup(sums: torch.Tensor) -> torch.Tensor:
    return speed_ratio(sums[:4]) / speed_ratio(sums[4:])


def margin(a: Candidate, b: Candidate, turns: Sequence[Turn], **kwargs: Any) -> Interval:
    """``a``'s speedup over ``b``'s on ``turns``, with a paired percentile-bootstrap interval (the module docstring;
    ``kwargs``: ``level``, ``resamples``, ``seed`` of :func:`~inference.evaluation.intervals.bootstrap_interval`).

    Raises:
        ValueError: no turn.
    """
    if not turns:
        raise ValueError("no prompt turn answered by both candidates")
    return bootstrap_interval(torch.cat([_columns(a, turns), _columns(b, turns)]), _speedup_over_speedup, **kwargs)


def _choose(candidates: Sequence[Candidate], turns: Sequence[Turn]) -> dict[str, Any]:
    ranked = sorted(candidates, key=lambda c: speedup(c, turns), reverse=True)
    best = ranked[0]
    choice: dict[str, Any] = {"deploy": best.label, "decoder": best.decoder, "settings": best.settings,
                              "speedup": speedup(best, turns), "mean_accepted_tokens": best.mean_accepted_tokens,
                              "exact_match_vs_greedy": best.exact_match, "turns": len(turns)}
    if len(ranked) > 1:
        runner = ranked[1]
        interval = margin(best, runner, turns)
        choice.update(runner_up=runner.label, runner_up_speedup=speedup(runner, turns), margin=interval.record())
    return choice


def recommend(candidates: Sequence[Candidate]) -> dict[str, Any]:
    """``{"overall": choice, "categories": {category: choice}}`` (categories in the order of the first candidate's
    rows: the prompt set's), each choice ``{"deploy", "decoder", "settings",
    "speedup", "mean_accepted_tokens", "exact_match_vs_greedy", "turns", "runner_up", "runner_up_speedup",
    "margin": Interval.record()}`` (the runner-up's fields only with two candidates or more).

    Raises:
        ValueError: no candidate, or no prompt turn that every candidate answered.
    """
    if not candidates:
        raise ValueError("no candidate to recommend from: the run has no finished rows")
    shared = set(candidates[0].turns)
    for c in candidates[1:]:
        shared &= set(c.turns)
    turns = [t for t in candidates[0].turns if t in shared]  # the run's order (the prompt set's)
    if not turns:
        raise ValueError("no prompt turn was answered by every candidate: finish the runs (rerun medusa-eval in "
                         "the same output_dir to resume them) before asking what to deploy")
    categories: dict[str, list[Turn]] = {}
    for t in turns:
        categories.setdefault(candidates[0].categories.get(t, ""), []).append(t)
    out: dict[str, Any] = {"overall": _choose(candidates, turns), "categories": {}}
    if len(categories) > 1:
        out["categories"] = {cat: _choose(candidates, ts) for cat, ts in categories.items()}
    return out


def _settings_text(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None) or "its defaults"


def _margin_text(m: Mapping[str, Any]) -> str:
    return f"{m['estimate']:.2f}x {bounds_text(m)}"


def recommendation_markdown(rec: Mapping[str, Any], machine: str) -> str:
    """summary.md's closing section: what to deploy on ``machine`` (one line of CPU/GPU, dtype) overall, with its
    settings and margin, then the choice within each engine (``rec["engines"]``, when the run measured one), then a
    row per category."""
    overall = rec["overall"]
    text = ["## Recommendation", "", f"On this machine ({machine}), over {overall['turns']} prompt turns: deploy "
            f"**{overall['deploy']}** ({_settings_text(overall['settings'])}), {overall['speedup']:.2f}x plain "
            "decoding."]
    if "margin" in overall:
        m = overall["margin"]
        if m["low"] is None:
            verdict = "one prompt turn: no noise measured, so not shown to be beyond it"
        elif m["separated"]:
            verdict = "beyond the noise"
        else:
            verdict = f"within the noise: {overall['runner_up']} serves as well on this evidence"
        text[-1] += (f" Runner-up {overall['runner_up']} ({overall['runner_up_speedup']:.2f}x); margin "
                     f"{_margin_text(m)} ({m['level']:.0%} interval), {verdict}.")
    engines = rec.get("engines") or {}
    if engines:
        text += ["", "Within one engine (each row over that engine's plain decoding):", ""]
        for engine, c in engines.items():
            line = f"- {engine}: **{c['deploy']}**, {c['speedup']:.2f}x `{c['baseline']}`"
            m = c.get("margin")
            if m:
                beyond = "beyond the noise" if m["separated"] else "within the noise"
                line += (f"; runner-up {c['runner_up']} ({c['runner_up_speedup']:.2f}x), margin {_margin_text(m)}, "
                         f"{beyond}")
            text.append(line + ".")
    if rec.get("categories"):
        text += ["", "| category | deploy | speedup | runner-up | margin [interval] | beyond the noise |",
                 "| --- | --- | ---: | --- | ---: | --- |"]
        for cat, c in [*rec["categories"].items(), (OVERALL, overall)]:
            m = c.get("margin")
            shown = _margin_text(m) if m else "n/a"
            text.append(f"| {cat} | {c['deploy']} | {c['speedup']:.2f}x | {c.get('runner_up', 'n/a')} | {shown} | "
                        f"{'yes' if m and m['separated'] else 'no'} |")
    return "\n".join(text)


__all__ = ["Candidate", "candidates_from_rows", "margin", "recommend", "recommendation_markdown", "speedup"]
