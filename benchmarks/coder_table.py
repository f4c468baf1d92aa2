"""The table of a target where speculation pays: Qwen2.5-Coder-1.5B-Instruct, its 0.5B sibling as the draft model,
plain decoding, prompt lookup and Lookahead, in our decoders, vLLM and llama.cpp, on HumanEval, MT-Bench and
Spec-Bench (``docs/coder-1.5b.md``).

    bash launch/install_models.sh coder && bash launch/install_vllm.sh && bash launch/install_llamacpp.sh
    nohup python benchmarks/coder_table.py --cells ours:humaneval vllm:humaneval llamacpp:humaneval --commit \\
        > runs/coder/runner.log 2>&1 &
    python benchmarks/coder_table.py --render       # docs/coder-1.5b.md's table again, from the JSON
    python benchmarks/coder_table.py --explain      # add the step costs of cells measured before, from runs/coder

A cell is ``GROUP:SET``: one ``medusa-eval`` run (``OUT/GROUP-SET``, resumed after a kill) of the group's decoders
on the prompt set, the target ``model=qwen2_5_coder_1_5b``, the draft ``draft=qwen2_5_coder_0_5b``, greedy, batch 1,
``max_new_tokens`` 256 (a reply ends at its EOS, as a user's request does), ``dtype=auto``, interleaved per prompt.
A drafter of ours is the group ``DRAFTER-SIZE[/ENGINE]`` (``medusa-1``, ``hydra-1``, ``eagle3-1/vllm``, ...):

- first its recipe, ``bash launch/recipe_scale.sh DRAFTER SIZE`` with the 1.5B as the target (``SCALE_MODEL``, its
  frozen copy in bf16), ``SIZE`` x 700 ShareGPT conversations of which half ask for code (``data.code_share=0.5``)
  and none holds a HumanEval problem (``data.exclude_prompts=[humaneval]``), their first turns answered again by the
  1.5B through vLLM, the hidden-state cache, training, the export (``speculators/`` for vLLM, a GGUF for llama.cpp
  converted when its row runs) and the tree tuned on this CPU (``medusa-tune-tree``), all in ``OUT/drafters``, each
  step resumed after a kill and not redone once finished. The replies of a size are kept in the repository,
  ``data/coder/replies-SIZE.tar.gz`` (committed with ``--commit`` once the first drafter of the size trained) and
  unpacked before any later drafter of the size, even in another session on another machine;
- then its rows: our tree decoder (``tree``, with the tree the tuner chose) and ``composite`` (that tree and prompt
  lookup in one), or with ``/vllm`` plain vLLM and vLLM with the drafter (``vllm_medusa`` or ``vllm_eagle3``, a chain),
  with ``/llamacpp`` plain llama.cpp and llama.cpp with the drafter (``llamacpp_eagle3``), with ``/fp32`` our two in
  fp32 for exactness. A ``/llamacpp`` cell first sweeps ``llamacpp_eagle3``'s ``draft_max`` and drafter weight
  type (:data:`LLAMACPP_SWEEP`, one ``medusa-eval`` run each in ``OUT/DRAFTER-SIZE-llamacpp-sweep-SET/``, resumed)
  on :data:`SWEEP_PROMPTS` prompts that are not the table's (HumanEval's next problems; held-out ShareGPT first turns
  for the chat sets), and its row runs with the setting whose ``llamacpp_eagle3`` was fastest against its own run's
  plain llama.cpp (the row's ``settings``).

- groups: ``ours`` (``vanilla``, ``draft``, ``hf_assisted``, ``hf_prompt_lookup``, ``lookahead``), ``vllm``
  (``vllm``, ``vllm_draft``), ``vllmngram`` (``vllm``, ``vllm_ngram``: a vLLM engine takes 6.5-8.6 GB resident here,
  so two at most run beside ours) and ``llamacpp`` (``llamacpp``, ``llamacpp_draft``, ``llamacpp_ngram``); each
  engine's rows run without the other engines' processes resident (they would slow every row: docs/vllm.md), and
  each run has ``vanilla``, medusa-eval's baseline, so every row's tokens/s is on the same footing. ``fp32``: our
  group in fp32 on a few prompts and tokens, for greedy exactness (the ``exact fp32`` column of our rows);
- sets: ``humaneval`` (the first ``--humaneval`` problems as chat turns), ``mt_bench`` (the first question of each of
  its 8 categories, first turns), ``spec_bench`` (one question of each of its 13 categories, first turns).

Each cell's rows go into ``docs/coder-1.5b.json`` (a list of objects: ``cell``, ``prompts``, ``decoder``,
``engine``, ``drafter`` (null: no drafter of ours), ``tokens_per_second``, ``speedup`` (over the row's own engine's
plain row, ``baseline``), ``speedup_low``/``speedup_high`` (its 95% paired-bootstrap interval), ``tau``, ``exact``
(share of replies equal to the baseline's), ``new_tokens``, ``turns``, ``dtype``, ``cpu``, ``load_average``,
``date``, ``commit``; ``settings``: a ``llamacpp_eagle3`` row's swept ``draft_max`` and ``outtype``);
``docs/coder-1.5b.md``'s table is rewritten between its markers, and the headline the README and
``docs/results.md`` lead with between theirs; with ``--commit`` those files are committed after each cell. A cell
already in the JSON is not run again (delete its rows to redo it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from data_scaling import archive_replies, commit, cpu_model, git, restore_replies, run  # noqa: E402
from inference.evaluation.results import RESULTS_FILE, read_rows  # noqa: E402
from inference.registry import REGISTRY, takes_draft  # noqa: E402
from medusa_train.models.catalog import drafter_type  # noqa: E402
from medusa_train.files.atomic import atomic_write_text  # noqa: E402
from medusa_train.config.precision import cpu_flags  # noqa: E402

TARGET, DRAFT = "qwen2_5_coder_1_5b", "qwen2_5_coder_0_5b"
GROUPS = {
    "ours": ["vanilla", "draft", "hf_assisted", "hf_prompt_lookup", "lookahead"],
    "vllm": ["vanilla", "vllm", "vllm_draft"],
    "vllmngram": ["vanilla", "vllm", "vllm_ngram"],  # two vLLM engines at most beside ours: 24 GB of RAM
    "llamacpp": ["vanilla", "llamacpp", "llamacpp_draft", "llamacpp_ngram"],
    "fp32": ["vanilla", "draft", "hf_assisted", "hf_prompt_lookup", "lookahead"],
}
# llama.cpp's EAGLE-3 settings swept before a /llamacpp cell: the drafted chain's length and the drafter's weights
# (its one layer and 4,096-token head are about 4% of the 1.5B's weights, so longer chains than the 135M's best, 1,
# may pay; docs/llamacpp.md)
LLAMACPP_SWEEP = {"draft_max": (2, 3, 5), "outtype": ("f32", "q8_0")}
SWEEP_PROMPTS, SWEEP_TOKENS = 4, 96
VLLM_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: 4,096 tokens of the 1.5B's cache take 0.11 GiB
DRAFTERS = ("medusa", "hydra", "eagle3")  # what launch/recipe_scale.sh trains
DRAFTER_GROUPS = {"": ["vanilla", "tree", "composite"], "fp32": ["vanilla", "tree", "composite"],
                  "vllm": ["vanilla", "vllm", "{vllm}"], "llamacpp": ["vanilla", "llamacpp", "llamacpp_eagle3"]}
# the drafters' recipe for the 1.5B (launch/recipe_scale.sh's knobs): half the conversations about code, none holding
# a HumanEval problem, the frozen target in bf16 (its hidden states as dtype=auto decodes them)
RECIPE_ENV = {"SCALE_MODEL": TARGET, "SCALE_MODEL_DTYPE": "bfloat16", "SCALE_CODE_SHARE": "0.5",
              "SCALE_EXCLUDE": "humaneval"}
REPLIES = ROOT / "data" / "coder"  # replies-SIZE.tar.gz: the 1.5B's regenerated replies of each size
SETS = ("humaneval", "mt_bench", "spec_bench")
MAX_NEW_TOKENS = 256
TABLE = ROOT / "docs" / "coder-1.5b.json"
DOC = ROOT / "docs" / "coder-1.5b.md"
BEGIN, END = "<!-- table: benchmarks/coder_table.py --render -->", "<!-- end of table -->"
# the headline the README's first screen and docs/results.md lead with, rendered from the same rows
HEADLINE_DOCS = (ROOT / "README.md", ROOT / "docs" / "results.md")
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline: benchmarks/coder_table.py --render -->", "<!-- end of headline -->"
NGRAM = ("hf_prompt_lookup", "vllm_ngram", "llamacpp_ngram")  # each engine's copying from the prompt


def parse_cell(text: str) -> tuple[str, str]:
    """``GROUP:SET`` -> ``(group, set)``; GROUP one of :data:`GROUPS` or a drafter's ``DRAFTER-SIZE[/ENGINE]``.

    Raises:
        ValueError: an unknown group, drafter, engine or set, a size that is not a positive integer (each named).
    """
    group, _, prompts = text.partition(":")
    if prompts not in SETS:
        raise ValueError(f"--cells {text!r}: write GROUP:SET with SET one of {', '.join(SETS)}")
    if group not in GROUPS:
        try:
            drafter_cell(group)
        except ValueError as e:
            raise ValueError(f"--cells {text!r}: {e}; or GROUP one of {', '.join(GROUPS)}") from None
    return group, prompts


def drafter_cell(group: str) -> tuple[str, int, str]:
    """``DRAFTER-SIZE[/ENGINE]`` -> ``(drafter, size, engine)`` (engine "" for our decoders).

    Raises:
        ValueError: not of that shape (the drafters and engines named).
    """
    name, _, engine = group.partition("/")
    drafter, _, size = name.partition("-")
    if drafter not in DRAFTERS or not size.isdigit() or int(size) < 1 or engine not in DRAFTER_GROUPS:
        raise ValueError(f"a drafter's group is DRAFTER-SIZE[/ENGINE] with DRAFTER one of {', '.join(DRAFTERS)}, SIZE "
                         f"a positive integer, ENGINE one of {', '.join(e for e in DRAFTER_GROUPS if e)}")
    if engine == "llamacpp" and drafter != "eagle3":
        raise ValueError(f"llama.cpp loads EAGLE-3 drafters only, not {drafter}")
    if engine == "vllm" and drafter_type(drafter).vllm_method is None:
        raise ValueError(f"vLLM serves no {drafter} drafter")
    return drafter, int(size), engine


def eval_overrides(group: str, prompts: str, humaneval: int, export: Path | None = None,
                   settings: dict[str, Any] | None = None) -> list[str]:
    """The ``medusa-eval`` overrides of cell ``group:prompts`` (besides output_dir); a drafter's cell evaluates
    ``export`` (the target is the one it records), a /llamacpp one with ``llamacpp_eagle3``'s swept ``settings``."""
    selection = {"humaneval": ["prompts=humaneval", f"num_prompts={humaneval}"],
                 "mt_bench": ["prompts=mt_bench", "per_category=1", "max_turns=1"],
                 "spec_bench": ["prompts=spec_bench", "per_category=1", "max_turns=1"]}[prompts]
    if is_fp32(group):  # exactness, not speed: a few prompts and tokens in fp32
        selection = [s for s in selection if not s.startswith(("num_prompts", "per_category"))] + ["num_prompts=3"]
        precision = ["dtype=float32", "max_new_tokens=48", "warmup=0"]
    else:
        precision = ["dtype=auto", f"max_new_tokens={MAX_NEW_TOKENS}"]
    # K = 3 drafted tokens for our draft decoders: the 0.5B costs 0.41 of a target token and a pass over 4 tokens
    # 1.14x one here (docs/coder-1.5b.md, the latency curve), which the draft-model speedup formula puts at K = 3-4;
    # both stop after a draft token below 0.4 probability (transformers' default for hf_assisted)
    lengths = ["decoder.draft.num_draft_tokens=3", "decoder.hf_assisted.num_draft_tokens=3",
               "decoder.draft.confidence_threshold=0.4"]
    if export is not None:
        drafter, _, engine = drafter_cell(group)
        method = drafter_type(drafter).vllm_method
        decoders = [d.format(vllm=f"vllm_{method}") for d in DRAFTER_GROUPS[engine]]
        return [f"export_dir={export}", f"decoders=[{','.join(decoders)}]", *selection, *precision,
                *eagle3_overrides(settings or {})]
    return [f"model={TARGET}", f"draft={DRAFT}", f"decoders=[{','.join(GROUPS[group])}]", *selection, *precision,
            *(lengths if group in ("ours", "fp32") else [])]


def eagle3_overrides(settings: dict[str, Any]) -> list[str]:
    """``llamacpp_eagle3``'s settings (``{"draft_max": 3, ...}``) as ``medusa-eval`` overrides."""
    return [f"decoder.llamacpp_eagle3.{k}={v}" for k, v in settings.items()]


def log_of(folder: Path) -> Path:
    """The log written beside a ``medusa-eval`` run's folder (``FOLDER.log``)."""
    return folder.with_name(folder.name + ".log")


def sweep_points() -> list[dict[str, Any]]:
    """The settings :data:`LLAMACPP_SWEEP` spans, each ``{"draft_max": d, "outtype": o}``."""
    return [{"draft_max": d, "outtype": o} for d in LLAMACPP_SWEEP["draft_max"] for o in LLAMACPP_SWEEP["outtype"]]


def sweep_overrides(prompts: str, humaneval: int, export: Path, point: dict[str, Any]) -> list[str]:
    """One sweep run's ``medusa-eval`` overrides (besides output_dir): ``point``'s settings, on prompts the table's
    cell of set ``prompts`` does not use (HumanEval's problems after its first ``humaneval``; held-out ShareGPT first
    turns for MT-Bench and Spec-Bench)."""
    selection = (["prompts=humaneval", f"prompt_offset={humaneval}"] if prompts == "humaneval"
                 else ["prompts=sharegpt", "max_turns=1"])
    return [f"export_dir={export}", "decoders=[vanilla,llamacpp,llamacpp_eagle3]", *selection,
            f"num_prompts={SWEEP_PROMPTS}", "dtype=auto", f"max_new_tokens={SWEEP_TOKENS}", *eagle3_overrides(point)]


def best_point(summaries: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The sweep's setting whose ``llamacpp_eagle3`` decoded fastest against its own run's plain ``llamacpp``.

    Args:
        summaries: ``(point, summary.json)`` of each sweep run.

    Raises:
        ValueError: no run has both rows with a speed.
    """
    def speed(m: dict[str, Any], name: str) -> float:
        return (m.get(name) or {}).get("tokens_per_second") or 0.0

    ratios = [(speed(m, "llamacpp_eagle3") / speed(m, "llamacpp"), -i) for i, (_, summary) in enumerate(summaries)
              if speed(m := summary.get("decoders") or {}, "llamacpp") > 0 and speed(m, "llamacpp_eagle3") > 0]
    if not ratios:
        raise ValueError("the llama.cpp sweep has no run with both llamacpp and llamacpp_eagle3 rows: see its logs")
    return summaries[-max(ratios)[1]][0]  # a tie: the first point swept (the shorter chain, f32)


def sweep(group: str, prompts: str, export: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The /llamacpp cell's sweep (each run resumed, a finished one read back) -> the chosen settings."""
    folder = Path(args.out) / f"{group.replace('/', '-')}-sweep-{prompts}"
    medusa_eval = str(Path(sys.executable).with_name("medusa-eval"))
    done = []
    for point in sweep_points():
        out = folder / "_".join(f"{k}-{v}" for k, v in point.items())  # Hydra reads , and = in output_dir
        if not (out / "summary.json").is_file():
            run([medusa_eval, f"output_dir={out}", *sweep_overrides(prompts, args.humaneval, export, point)],
                log_of(out))
        done.append((point, json.loads((out / "summary.json").read_text(encoding="utf-8"))))
    chosen = best_point(done)
    print(f"{group}:{prompts}: llama.cpp sweep chose {chosen}", flush=True)
    return chosen


def rows_of(cell: str, group: str, prompts: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows of one cell's ``summary.json``: every decoder but ``vanilla`` in the engine groups (it is in
    ``ours``), each with its speedup over its own engine's plain row."""
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    drafter = None if group in GROUPS else group.split("/")[0]
    out = []
    for name, m in summary["decoders"].items():
        if drafter is not None and name in ("vanilla", "vllm", "llamacpp"):
            continue  # the plain rows come from the cells without a drafter
        if (name == "vanilla" and group not in ("ours", "fp32")) or (name == "vllm" and group == "vllmngram"):
            continue  # each plain row once: vanilla from ours, plain vLLM from the vllm cell
        interval = m.get("speedup_interval") or {}
        out.append({
            "cell": cell, "prompts": prompts, "decoder": name, "engine": REGISTRY[name].engine, "drafter": drafter,
            "tokens_per_second": m["tokens_per_second"], "speedup": m["speedup"], "baseline": m.get("baseline"),
            "speedup_low": interval.get("low"), "speedup_high": interval.get("high"),
            "tau": m["mean_accepted_tokens"], "exact": m["exact_match_vs_greedy"], "new_tokens": m["new_tokens"],
            "turns": summary["prompts"], "dtype": summary["dtype"],
            "cpu": {"model": cpu_model(), "flags": flags, "cores": os.cpu_count()},
            "load_average": summary.get("load_average"),
            "date": datetime.now(timezone.utc).date().isoformat(), "commit": git("rev-parse", "--short", "HEAD"),
        })
    return out


PLAIN_OF = {"ours": "vanilla", "vllm": "vllm", "llamacpp": "llamacpp"}  # each engine's plain row


def step_costs(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Add to each speed row of one cell what its speedup is made of, from the run's ``results.jsonl``:
    ``prefill_s`` (its prompts' prefill, seconds, summed), ``step_s`` (decoding seconds per step: a draft-and-verify
    step, or a token for a plain row), ``step_cost`` (``step_s`` over its engine's plain row's, in the same run:
    the step's price in plain tokens) and ``predicted_speedup`` (``tau / step_cost``: the decoding phase's speedup,
    without the prefill). The steps are ``new_tokens / tau`` (the table's τ). A row whose plain row is not in the run
    (vLLM's n-gram cell has its own plain vLLM row) is priced against that one."""
    results = run_dir / RESULTS_FILE
    if not rows or is_fp32(rows[0]["cell"]) or not results.is_file():
        return
    totals: dict[str, list[float]] = {}
    for r in read_rows(results):
        t = totals.setdefault(r["decoder"], [0.0, 0.0, 0])
        t[0] += r["wall_time_s"]
        t[1] += r.get("prefill_time_s") or 0.0
        t[2] += r["new_tokens"]
    taus = {r["decoder"]: r["tau"] for r in rows}

    def step_s(name: str, tau: float) -> float:
        wall, prefill, tokens = totals[name]
        return (wall - prefill) / (tokens / tau)

    for r in rows:
        plain = PLAIN_OF[r["engine"]]
        if r["decoder"] not in totals or plain not in totals:
            continue
        r["prefill_s"] = totals[r["decoder"]][1]
        r["step_s"] = step_s(r["decoder"], r["tau"])
        r["step_cost"] = r["step_s"] / step_s(plain, taus.get(plain, 1.0))
        r["predicted_speedup"] = r["tau"] / r["step_cost"]


def is_fp32(cell: str) -> bool:
    """Whether ``cell`` is an exactness cell (``fp32:SET``, ``DRAFTER-SIZE/fp32:SET``), not a speed one."""
    return cell.split(":")[0].split("/")[-1] == "fp32"


def read_table() -> list[dict[str, Any]]:
    return json.loads(TABLE.read_text(encoding="utf-8")) if TABLE.is_file() else []


def _f(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table per prompt set: a row per decoder (speed cells), our rows with their fp32 exactness."""
    exact32 = {(r["prompts"], r["decoder"], r["drafter"]): r["exact"] for r in rows if is_fp32(r["cell"])}
    lines = []
    for prompts in SETS:
        mine = [r for r in rows if r["prompts"] == prompts and not is_fp32(r["cell"])]
        if not mine:
            continue
        order = {name: i for i, name in enumerate(dict.fromkeys(n for g in GROUPS for n in GROUPS[g]))}
        mine.sort(key=lambda r: (("ours", "vllm", "llamacpp").index(r["engine"]), r["drafter"] or "",
                                 order.get(r["decoder"], 99)))
        turns = mine[0]["turns"]
        lines += [f"**{prompts}** ({turns} prompts, up to {MAX_NEW_TOKENS} new tokens)", "",
                  "| engine | decoder | drafter | tokens/s | speedup over | speedup [95%] | τ | exact | exact fp32 | "
                  "CPU (load) |", "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
        for r in mine:
            cpu = "AMX" if "amx_bf16" in r["cpu"]["flags"] else "AVX-512 BF16" if "avx512_bf16" in r["cpu"]["flags"] \
                else "AVX2"
            load = r.get("load_average") or {}
            load_text = f"{load['before'][0]:.1f}/{load['after'][0]:.1f}" if load else "n/a"
            drafter = r["drafter"] or ("Qwen2.5-Coder-0.5B" if takes_draft(r["decoder"]) else "none")
            if r.get("settings"):
                drafter += " (" + ", ".join(f"{k} {v}" for k, v in r["settings"].items()) + ")"
            lines.append(f"| {r['engine']} | {r['decoder']} | {drafter} | "
                         f"{_f(r['tokens_per_second'])} | {r['baseline'] or 'n/a'} | {_f(r['speedup'])}x "
                         f"[{_f(r['speedup_low'])}, {_f(r['speedup_high'])}] | {_f(r['tau'])} | {_f(r['exact'])} | "
                         f"{_f(exact32.get((r['prompts'], r['decoder'], r['drafter'])))} | {cpu} ({load_text}) |")
        lines.append("")
        priced = [r for r in mine if r.get("step_cost") is not None and r["decoder"] not in PLAIN_OF.values()]
        if priced:
            lines += [f"What each {prompts} speedup is made of (decoding only, from the same runs):", "",
                      "| engine | decoder | τ | a step, ms | a step, in plain tokens | τ / that | measured speedup |",
                      "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['engine']} | {r['decoder']} | {_f(r['tau'])} | {_f(1000 * r['step_s'], '.0f')} | "
                      f"{_f(r['step_cost'])} | {_f(r['predicted_speedup'])}x | {_f(r['speedup'])}x |" for r in priced]
            lines.append("")
    return "\n".join(lines)


def _best(rows: list[dict[str, Any]]) -> str:
    """The fastest of ``rows`` as a headline cell: ``decoder (drafter) speedup [interval]``, or a dash."""
    rows = [r for r in rows if r.get("speedup") is not None]
    if not rows:
        return "-"
    r = max(rows, key=lambda r: r["speedup"])
    who = f" ({r['drafter']})" if r["drafter"] else ""
    return f"`{r['decoder']}`{who} {_f(r['speedup'])}x [{_f(r['speedup_low'])}, {_f(r['speedup_high'])}]"


def headline(rows: list[dict[str, Any]]) -> str:
    """The headline table: per prompt set and engine, plain decoding's tokens/s and the fastest row of each kind of
    drafting (our drafters, the 0.5B draft model, n-gram / prompt lookup), each over that engine's plain row."""
    lines = ["| prompts | engine | plain tokens/s | with our drafters | with the 0.5B draft model | "
             "n-gram / prompt lookup |", "| --- | --- | ---: | --- | --- | --- |"]
    speed = [r for r in rows if not is_fp32(r["cell"])]
    for prompts in SETS:
        for engine, plain in PLAIN_OF.items():
            mine = [r for r in speed if r["prompts"] == prompts and r["engine"] == engine]
            base = [r for r in mine if r["decoder"] == plain]
            if not base:
                continue
            lines.append(f"| {prompts} ({base[0]['turns']}) | {engine} | {_f(base[0]['tokens_per_second'])} | "
                         f"{_best([r for r in mine if r['drafter']])} | "
                         f"{_best([r for r in mine if takes_draft(r['decoder'])])} | "
                         f"{_best([r for r in mine if r['decoder'] in NGRAM])} |")
    return "\n".join(lines) + "\n"


def _between(text: str, where: Path, begin: str, end: str, body: str) -> str:
    """``text`` with ``body`` between the markers ``begin`` and ``end`` (the text around them kept).

    Raises:
        ValueError: the markers missing, out of order or given twice (``where`` named).
    """
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: the markers {begin!r} and {end!r} must each be there once, in that order: put "
                         "them back around the table")
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}{end}{rest.split(end, 1)[1]}"


def render(rows: list[dict[str, Any]]) -> None:
    """Rewrite the tables in ``docs/coder-1.5b.md`` and the headline in :data:`HEADLINE_DOCS`, each between its
    markers; every file is checked and rendered before the first is written.

    Raises:
        ValueError: a file without its markers; FileNotFoundError: a headline file missing (nothing written).
    """
    doc = DOC.read_text(encoding="utf-8") if DOC.is_file() else f"# Qwen2.5-Coder-1.5B\n\n{BEGIN}\n{END}\n"
    texts = {DOC: _between(doc, DOC, BEGIN, END, markdown(rows))}
    body = headline(rows)
    for path in HEADLINE_DOCS:
        texts[path] = _between(path.read_text(encoding="utf-8"), path, HEADLINE_BEGIN, HEADLINE_END, body)
    for path, text in texts.items():
        atomic_write_text(path, text)


def train(drafter: str, size: int, args: argparse.Namespace) -> Path:
    """The drafter's recipe (see the module docstring), resumed or skipped where done -> its export folder."""
    out = Path(args.out) / "drafters"
    log = out / f"{drafter}-{size}.log"
    replies, archive = out / f"replies-{size}", REPLIES / f"replies-{size}.tar.gz"
    restored = restore_replies(archive, replies)
    if restored:
        print(f"{drafter}-{size}: {restored} reply blocks unpacked from {archive}", flush=True)
    run(["bash", "launch/recipe_scale.sh", drafter, str(size)], log, {"SCALE_OUT": str(out), **RECIPE_ENV})
    if archive_replies(replies, archive) and args.commit:
        commit([archive], f"coder-1.5b: the 1.5B's regenerated replies of size {size} ({archive.name})")
    return out / f"{drafter}-{size}" / "export"


def run_folder(out: str | Path, group: str, prompts: str) -> Path:
    """The ``medusa-eval`` folder of cell ``group:prompts`` in ``out`` (its log beside it, ``.log``)."""
    return Path(out) / f"{group.replace('/', '-')}-{prompts}"


def measure(group: str, prompts: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One cell's ``medusa-eval`` run (resumed when its folder holds a part of it; a drafter's recipe first) -> its
    rows."""
    cell = f"{group}:{prompts}"
    out = run_folder(args.out, group, prompts)
    log = log_of(out)
    export, settings = None, None
    if group not in GROUPS:
        drafter, size, engine = drafter_cell(group)
        export = train(drafter, size, args)
        if engine == "llamacpp":
            settings = sweep(group, prompts, export, args)
    medusa_eval = str(Path(sys.executable).with_name("medusa-eval"))
    run([medusa_eval, f"output_dir={out}", *eval_overrides(group, prompts, args.humaneval, export, settings)], log,
        {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", VLLM_KV_CACHE_GIB)})
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    rows = rows_of(cell, group, prompts, summary)
    for r in rows:
        if settings and r["decoder"] == "llamacpp_eagle3":
            r["settings"] = settings
    step_costs(out, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="*", default=[], help="GROUP:SET or DRAFTER-SIZE[/ENGINE]:SET, in order")
    parser.add_argument("--out", default="runs/coder", help="the runs' folder")
    parser.add_argument("--humaneval", type=int, default=20, help="HumanEval problems (the first N)")
    parser.add_argument("--commit", action="store_true", help="commit the table's files after each cell")
    parser.add_argument("--render", action="store_true", help="only rewrite the Markdown tables from the JSON")
    parser.add_argument("--explain", action="store_true",
                        help="only add each row's step costs from its run in --out (cells measured before) and render")
    args = parser.parse_args(argv)
    try:
        cells = [parse_cell(c) for c in args.cells]
    except ValueError as e:
        parser.error(str(e))
    if args.humaneval < 1:
        parser.error(f"--humaneval {args.humaneval}: give a number of problems >= 1")
    if args.render or args.explain:
        table = read_table()
        if args.explain:
            for cell in dict.fromkeys(r["cell"] for r in table):
                group, prompts = cell.split(":")
                run_dir = run_folder(args.out, group, prompts)
                step_costs(run_dir, [r for r in table if r["cell"] == cell])
            atomic_write_text(TABLE, json.dumps(table, indent=1, ensure_ascii=False) + "\n")
        render(table)
        return 0
    for group, prompts in cells:
        cell = f"{group}:{prompts}"
        if any(r["cell"] == cell for r in read_table()):
            print(f"{cell}: in {TABLE} already, not run again", flush=True)
            continue
        print(f"{cell}: running (log: {log_of(run_folder(args.out, group, prompts))})", flush=True)
        rows = measure(group, prompts, args)
        table = [r for r in read_table() if r["cell"] != cell] + rows
        atomic_write_text(TABLE, json.dumps(table, indent=1, ensure_ascii=False) + "\n")
        render(table)
        print(f"{cell}: done, " + ", ".join(f"{r['decoder']} {_f(r['speedup'])}x" for r in rows), flush=True)
        if args.commit:
            commit([TABLE, DOC, *HEADLINE_DOCS], f"coder-1.5b: cell {cell}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
