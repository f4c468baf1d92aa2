"""One ``medusa-eval`` run: check the settings, load the prompts and the export, build the decoders, measure, write.

Files in the output folder:

- ``run.json``: the resolved config, the command-line overrides and command, the environment (device, dtype,
  torch threads, versions, git commit), what each decoder resolved (e.g. the Medusa tree and its source), and
  ``measured_with``: what the rows were measured with (:mod:`inference.evaluation.provenance`: the base model config,
  each decoder's settings, resolved tree and heads' checksum, and each one's fingerprint, which its rows carry).
- ``results.jsonl``: one row per (prompt, turn, decoder) (:mod:`inference.evaluation.results`);
  ``results_superseded.jsonl``: rows a rerun measured again (see below).
- ``summary.json`` (:func:`~inference.evaluation.summary.summarize`'s fields, plus ``skipped_prompts`` when some prompt turns did not fit the context),
  ``summary.md`` (a table per category and overall), ``summary_details.json`` (the same tables by category and the
  accepted-length histogram), PNG plots.

The folder must be new, empty or a run of ours (:mod:`inference.evaluation.eval_folder`: ``run.json`` records
``"tool": "medusa-eval"``), or the run is refused before any model loads; a run holds the folder's lock from then to
its end, so a second run into the folder is refused while the first runs.

A rerun in the same folder resumes: finished rows are kept, the rest measured; more prompts or turns extend the run
(:data:`~inference.evaluation.eval_config.RESUMABLE_KEYS`). A decoder whose settings or resolved inputs changed (e.g. the
tree ``medusa-tune-tree`` rewrote, or new heads) has its rows measured again, the old ones moved to
``results_superseded.jsonl``; the other decoders' rows are kept. A rerun whose shared settings (``max_new_tokens``,
temperature, the decoder list, ...) or base model (name, dtype, device, ...) changed is refused before any model
loads, naming what changed (``overwrite=true`` starts over). The summary covers the current prompt selection.
"""

from __future__ import annotations

import dataclasses
import os
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from inference.decoders.chat import eos_ids
from inference.evaluation.divergence import explain_divergences, find_divergences, rounding_noise
from inference.evaluation.environment import describe_environment
from inference.evaluation.eval_config import BASELINE, RESUMABLE_KEYS, EvaluateConfig
from inference.evaluation.eval_folder import TOOL, TOOL_KEY, check_eval_dir, hold_eval_dir, hydra_entries
from inference.evaluation.plots import write_plots
from inference.evaluation.provenance import MEASURED_WITH, decoder_identity, differences, fingerprint, run_identity
from inference.evaluation.recommend import candidates_from_rows, recommend
from inference.evaluation.results import RESULTS_FILE, SUPERSEDED_FILE, ResultsLog
from inference.evaluation.runner import conversation_messages, evaluate_prompts
from inference.evaluation.summary import (
    OVERALL,
    accepted_length_histogram,
    complete_units,
    step_times,
    summarize,
    summary_markdown,
    tables_by_category,
)
from inference.evaluation.sweep import RUN_FILE, SUMMARY_FILE
from inference.registry import (
    ENGINES,
    REGISTRY,
    BuildContext,
    BuiltDecoder,
    build_decoders,
    close_decoders,
    takes_draft,
    with_run_draft,
)
from medusa_train.files.atomic import atomic_write_text
from medusa_train.config.schema import as_dataclass
from medusa_train.export.files import write_json
from medusa_train.export.reader import heads_checksum
from medusa_train.export.tree_files import read_tree_files
from medusa_train.models.generation import max_positions
from medusa_train.loading.export import ORIGINAL_BASE_KEY, export_base_config, model_config_for_export
from medusa_train.loading.runtime import (
    InferenceRuntime,
    load_for_inference,
    load_target_for_inference,
    target_config,
)
from medusa_train.chat.prompts import PROMPT_SOURCES, Prompt, encode_prompt, load_prompts

log = logging.getLogger(__name__)

SUMMARY_MD = "summary.md"
DETAILS_FILE = "summary_details.json"


def load_eval_prompts(ec: EvaluateConfig) -> list[Prompt]:
    """The prompt set ``ec.prompts`` names (a source name or a JSONL file): ``prompt_offset`` skipped, then only the
    ``categories`` asked for, then the first ``per_category`` of each category, then the first ``num_prompts``.

    Raises:
        FileNotFoundError / ValueError: as :func:`medusa_train.chat.prompts.load_prompts` (a malformed line's number); a
            category in ``categories`` that the set does not hold (the set's categories listed).
    """
    source, path = (ec.prompts, None) if ec.prompts in PROMPT_SOURCES else ("jsonl", ec.prompts)
    if (ec.per_category is None and not ec.categories) or source == "sharegpt":  # ShareGPT: one category
        prompts = load_prompts(source, path, ec.prompt_offset, ec.num_prompts)
    else:
        prompts = _select(ec, load_prompts(source, path, ec.prompt_offset))
    if not prompts:
        total = len(load_prompts(source, path)) if source != "sharegpt" else None
        raise ValueError(f"no prompt selected from prompts={ec.prompts}: prompt_offset={ec.prompt_offset} skips "
                         f"past its {total} prompts; use a prompt_offset below {total}")
    return prompts


def _select(ec: EvaluateConfig, prompts: list[Prompt]) -> list[Prompt]:
    """``categories``, then ``per_category``, then ``num_prompts`` (see :func:`load_eval_prompts`)."""
    if ec.categories:
        held = list(dict.fromkeys(p.category for p in prompts))
        unknown = [c for c in ec.categories if c not in held]
        if unknown:
            raise ValueError(f"categories: {unknown} not in prompts={ec.prompts}; its categories are "
                             f"{', '.join(held)}")
        prompts = [p for p in prompts if p.category in ec.categories]
    if ec.per_category is None:
        return prompts[: ec.num_prompts] if ec.num_prompts else prompts
    taken: dict[str, int] = {}
    selected = []
    for prompt in prompts:
        if taken.get(prompt.category, 0) < ec.per_category:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            selected.append(prompt)
    return selected[: ec.num_prompts] if ec.num_prompts else selected


def resolved_config(cfg: DictConfig | EvaluateConfig) -> dict[str, Any]:
    """The run's settings as plain data (interpolations resolved, Hydra's own node left out)."""
    if isinstance(cfg, EvaluateConfig):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    return data


def result_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings every row of a run shares: :data:`RESUMABLE_KEYS` left out, and the per-decoder settings
    (``decoder``, and ``draft``, which fills the draft-model decoders' settings), which only their own decoder's rows
    depend on (:mod:`inference.evaluation.provenance`)."""
    shared = {k: v for k, v in config.items() if k not in RESUMABLE_KEYS and k not in ("decoder", "draft")}
    shared["decoders"] = [BASELINE] + [n for n in shared.get("decoders", []) if n != BASELINE]  # as run_order
    return shared


def _previous_run(out_dir: Path) -> dict[str, Any]:
    path = out_dir / RUN_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({e}): cannot tell which settings made the results beside it; "
                         "choose another output_dir or pass overwrite=true") from e
    return data if isinstance(data, dict) else {}


def open_results(out_dir: Path, config: dict[str, Any], overwrite: bool,
                 identity: Callable[[], dict[str, Any]] | None = None) -> ResultsLog:
    """The run's results log, resumed when ``out_dir`` holds a run with the same shared settings and base model.

    Args:
        out_dir: the run folder.
        config: the run's resolved config.
        overwrite: discard the results there.
        identity: computes the run's :func:`~inference.evaluation.provenance.run_identity`, which is compared with
            the recorded one; called after the settings check, so a run refused for its settings reads no export
            (None: not compared).

    Raises:
        ValueError: ``out_dir`` holds results of other shared settings or of another base model (the differences
            listed), results without their ``run.json``, or results of an older medusa-train that did not record
            what they were measured with; ``overwrite=true`` discards them instead.
    """
    results_path, run_path = out_dir / RESULTS_FILE, out_dir / RUN_FILE
    if overwrite:
        results_path.unlink(missing_ok=True)
        out_dir.joinpath(SUPERSEDED_FILE).unlink(missing_ok=True)
        return ResultsLog(results_path)
    if results_path.is_file() and results_path.stat().st_size:
        if not run_path.is_file():
            raise ValueError(f"{results_path} exists without its {RUN_FILE}: cannot tell which settings made it; "
                             "choose another output_dir or pass overwrite=true")
        previous = _previous_run(out_dir)
        diffs = differences(result_settings(previous.get("config", {})), result_settings(config))
        if diffs:
            raise ValueError(f"{out_dir} holds results of other settings ({'; '.join(diffs)}); choose another "
                             "output_dir, or pass overwrite=true to discard them")
        if identity is not None:
            current = identity()
            recorded = previous.get(MEASURED_WITH, {}).get("run")
            if recorded is None:
                raise ValueError(f"{out_dir} holds results of an older medusa-train, which did not record what they "
                                 "were measured with (tree, heads, base model): pass overwrite=true to measure them "
                                 "again, or choose another output_dir")
            diffs = differences(recorded, current)
            if diffs:
                raise ValueError(f"{out_dir} holds results measured on another base model ({'; '.join(diffs)}); "
                                 "choose another output_dir, or pass overwrite=true to discard them")
    results = ResultsLog(results_path)
    if len(results):
        log.info("resuming %s: %d rows already measured are kept", results_path, len(results))
    return results


def supersede_stale_rows(out_dir: Path, results: ResultsLog, identities: dict[str, dict[str, Any]],
                         fingerprints: dict[str, str]) -> dict[str, str]:
    """Move the rows measured with another decoder identity (tree, heads, settings) than ``identities`` to
    ``results_superseded.jsonl``, so they are measured again. Returns decoder -> why (what changed).

    Raises:
        ValueError: the baseline's rows are stale (every later turn follows its answers: the whole run is).
    """
    stale: dict[str, list] = {}
    for key, row in results.rows.items():
        name = key[2]
        if name in fingerprints and row.get(MEASURED_WITH) != fingerprints[name]:
            stale.setdefault(name, []).append(key)
    if not stale:
        return {}
    recorded = _previous_run(out_dir).get(MEASURED_WITH, {}).get("decoders", {})
    reasons = {name: "; ".join(differences(recorded.get(name), identities[name])) or "measured with other settings"
               for name in stale}
    if BASELINE in stale:
        raise ValueError(f"{out_dir}: the {BASELINE} rows were measured with other settings ({reasons[BASELINE]}); "
                         "every later turn follows them: pass overwrite=true to measure the run again")
    for name, keys in stale.items():
        log.warning("%s: %d rows were measured with other settings (%s): measuring them again; the old rows are "
                    "kept in %s", name, len(keys), reasons[name], SUPERSEDED_FILE)
    results.supersede([k for keys in stale.values() for k in keys], reasons)
    return reasons


def _hydra_runtime() -> tuple[str | None, list[str]]:
    """(the job's output folder, its command-line overrides) under Hydra; (None, []) otherwise."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, []
    hc = HydraConfig.get()
    return hc.runtime.output_dir, list(hc.overrides.task)


def evaluate(cfg: DictConfig | EvaluateConfig, output_dir: str | Path | None = None,
             overrides: list[str] | None = None) -> dict[str, Any]:
    """Run ``medusa-eval`` with ``cfg`` and return the summary (``summary.json``'s content).

    Args:
        cfg: the composed ``evaluate`` config (or an :class:`EvaluateConfig`).
        output_dir: where to write; default the Hydra job's folder (a multirun's numbered subfolder), else
            ``cfg.output_dir``.
        overrides: the command-line overrides to record; default Hydra's.

    Raises:
        ValueError / FileNotFoundError: bad settings, an unknown decoder, a malformed prompt file (line named),
            results of other shared settings or another base model in the folder, an export without heads or
            without a base model, an output folder holding files that are not a medusa-eval run
            (:class:`~inference.evaluation.eval_folder.EvalDirError`): all before a model is loaded. Decoders that
            cannot be built for this model (e.g. a self-layers draft as deep as the target): all named at once,
            before any decoding.
        LockHeldError: another run is writing into the folder (named), before a model is loaded.
    """
    ec: EvaluateConfig = as_dataclass(EvaluateConfig, cfg)  # validates names and every decoder's settings
    hydra_dir, hydra_overrides = _hydra_runtime()
    out = Path(output_dir or hydra_dir or ec.output_dir)
    overrides = hydra_overrides if overrides is None else overrides
    check_eval_dir(out, hydra_entries())
    lock = hold_eval_dir(out)
    try:
        return _evaluate(cfg, ec, out, overrides)
    finally:
        lock.release()


def _evaluate(cfg: DictConfig | EvaluateConfig, ec: EvaluateConfig, out: Path, overrides: list[str]) -> dict[str, Any]:
    """:func:`evaluate` in its checked and held folder ``out``."""
    order = ec.run_order()
    if BASELINE not in ec.decoders:
        log.info("adding %s: it is the baseline of speedup and exact match", BASELINE)
    settings = {name: ec.settings_for(name) for name in order}
    prompts = load_eval_prompts(ec)
    config = resolved_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    identity: dict[str, Any] = {}

    def measure_identity() -> dict[str, Any]:  # the export's heads and base model, read only once settings match
        identity["heads_sha256"] = heads_checksum(ec.export_dir) if ec.export_dir is not None else None
        identity["run"] = run_identity(ec.export_dir, ec.model, ec.dtype, ec.device, identity["heads_sha256"])
        return identity["run"]

    results = open_results(out, config, ec.overwrite, measure_identity)
    if not identity:  # a fresh run: nothing to compare, but the record needs it (and a missing export fails here)
        measure_identity()

    if ec.threads is not None:
        torch.set_num_threads(ec.threads)
    if ec.export_dir is None:  # the target alone (no drafter of ours)
        model, tokenizer, runtime = load_target_for_inference(ec.model, dtype=ec.dtype, device=ec.device,
                                                              cpu_kernels=ec.cpu_kernels)
        export_config: dict[str, Any] = {}
        target = target_config(ec.model, runtime.dtype.name, ec.device)
    else:
        model, tokenizer, export_config, runtime = load_for_inference(ec.export_dir, model=ec.model, dtype=ec.dtype,
                                                                      device=ec.device, cpu_kernels=ec.cpu_kernels)
        target = dataclasses.replace(export_base_config(ec.export_dir, export_config, ec.model, ec.dtype, ec.device),
                                     dtype=runtime.dtype.name)
    ctx = BuildContext(model=model, tokenizer=tokenizer, export_dir=ec.export_dir, dtype=runtime.dtype.name,
                       device=ec.device, kernels=runtime.kernels, model_config=target)
    built = build_decoders(settings, ctx)
    try:
        return _run(ec, out, overrides, prompts, config, results, identity, model, tokenizer, export_config,
                    runtime, built)
    finally:
        close_decoders(built)  # engines in other processes (vLLM) stop with the run


def _run(ec: EvaluateConfig, out: Path, overrides: list[str], prompts: list[Prompt], config: dict[str, Any],
         results: ResultsLog, identity: dict[str, Any], model: Any, tokenizer: Any, export_config: dict[str, Any],
         runtime: InferenceRuntime, built: dict[str, BuiltDecoder]) -> dict[str, Any]:
    """Measure the built decoders on ``prompts`` and write the run's files (the second half of :func:`evaluate`)."""
    identities = decoder_identities(built, config, identity["heads_sha256"])
    fingerprints = {name: fingerprint(i) for name, i in identities.items()}
    remeasured = supersede_stale_rows(out, results, identities, fingerprints)
    environment = {**describe_environment(model.base), **runtime.record()}
    # A Medusa-2 export records its fine-tuned base as "base" (inside it): name the model it was made from.
    if ec.export_dir is None:
        model_name = target_config(ec.model).name_or_path
    elif ec.model is None:
        model_name = export_config.get(ORIGINAL_BASE_KEY, export_config.get("base_model_name_or_path"))
    else:
        model_name = model_config_for_export(export_config, ec.model).name_or_path
    command = " ".join(["medusa-eval", *overrides]) if overrides else None
    write_json(out / RUN_FILE, {TOOL_KEY: TOOL, "config": config, "overrides": overrides, "command": command,
                                "environment": environment, "model": model_name,
                                "decoders": {name: b.info for name, b in built.items()},
                                MEASURED_WITH: {"run": identity["run"], "decoders": identities,
                                                "fingerprints": fingerprints},
                                "resumed_rows": len(results), "remeasured": remeasured})

    request = ec.request(eos_ids(tokenizer, getattr(model.base, "generation_config", None)))
    # every decoder's compute threads (an engine in another process records its own), and the machine's load around
    # the run: what says that each decoder was timed alone on equal threads
    threads = {name: b.info.get("compute_threads", torch.get_num_threads()) for name, b in built.items()}
    load_before = os.getloadavg()
    run = evaluate_prompts({name: b.decoder for name, b in built.items()}, tokenizer, prompts, request, results,
                           baseline=BASELINE, max_turns=ec.max_turns, warmup=ec.warmup,
                           warmup_max_new_tokens=ec.warmup_max_new_tokens, progress=ec.progress,
                           context=max_positions(model.base.config), fingerprints=fingerprints)
    load_after = os.getloadavg()
    divergences = divergence_report(run.rows, ec, model, tokenizer, prompts, built) if ec.greedy else None
    return write_outputs(out, run.rows, ec, model_name, environment, command, export_dir=ec.export_dir,
                         skipped=run.skipped, divergences=divergences, threads=threads,
                         load_average={"before": list(load_before), "after": list(load_after)},
                         resolved={name: b.info for name, b in built.items()})


def engine_recommendations(rows: list[dict[str, Any]], names: list[str], settings: dict[str, Any],
                           taus: dict[str, Any], exact: dict[str, Any]) -> dict[str, Any]:
    """What to deploy within each engine that ran its plain row and at least one other: ``{engine: choice}``
    (:func:`~inference.evaluation.recommend.recommend`'s overall choice among that engine's rows, each scored over
    the engine's plain row: ``vanilla`` for ours, ``vllm``, ``llamacpp``), for a user who has chosen the engine; empty
    when the run measured one engine only (the overall choice is then that engine's)."""
    out: dict[str, Any] = {}
    if len({REGISTRY[n].engine for n in names if n in REGISTRY}) < 2:  # one engine: the overall choice is its own
        return out
    for engine in ENGINES:
        mine = [n for n in names if n in REGISTRY and REGISTRY[n].engine == engine]
        plain = BASELINE if engine == "ours" else engine
        if plain in mine and len(mine) > 1:
            engine_rows = [r for r in rows if r["decoder"] in mine]
            out[engine] = recommend(candidates_from_rows(engine_rows, plain, settings, taus, exact))["overall"]
            out[engine]["baseline"] = plain
    return out


def decoder_identities(built: dict[str, BuiltDecoder], config: dict[str, Any],
                       heads_sha256: str) -> dict[str, dict[str, Any]]:
    """Each decoder's :func:`~inference.evaluation.provenance.decoder_identity`: its settings as resolved in
    ``config`` (the run's ``draft`` filled in), what its builder resolved, the heads' checksum when it decodes with
    them."""
    def settings(name: str) -> Any:
        raw = (config.get("decoder") or {}).get(name)
        return with_run_draft(name, raw, config["draft"]) if config.get("draft") and takes_draft(name) else raw

    return {name: decoder_identity(settings(name), b.info, heads_sha256 if REGISTRY[name].uses_heads else None)
            for name, b in built.items()}


def divergence_report(rows: list[dict[str, Any]], ec: EvaluateConfig, model: Any, tokenizer: Any,
                      prompts: list[Prompt], built: dict[str, Any]) -> dict[str, Any]:
    """Greedy runs: which replies left vanilla's and whether each was a near-tie under this dtype's rounding
    (:mod:`inference.evaluation.divergence`); the rounding is measured only when some reply diverged."""
    units = list(complete_units(rows).values())
    found = find_divergences(units, BASELINE)
    noise = None
    if any(found.values()) and ec.noise_positions:
        replies = {r["prompt_id"]: r["tokens"] for r in rows if r["decoder"] == BASELINE and r["turn"] == 1}
        sequences = []
        for prompt in prompts:
            if prompt.id in replies:
                ids = encode_prompt(tokenizer, conversation_messages(prompt, [prompt.turns[0]], []))
                sequences.append((list(ids) + replies[prompt.id], len(ids)))
        ks = {2} | {int(b.info["tree_nodes"]) for b in built.values() if b.info.get("tree_nodes", 1) >= 2}
        log.info("measuring %s rounding noise at %d positions (k = %s) to explain %d divergent replies",
                 model.base.dtype, ec.noise_positions, sorted(ks), sum(len(v) for v in found.values()))
        noise = rounding_noise(model.base, sequences, sorted(ks), ec.noise_positions)
    return explain_divergences(found, noise, len(units))


# what a builder resolved that a recommendation names beside the settings: the file the tree came from, its nodes
# (root included) and the composite tree's split
RESOLVED_KEYS = ("tree_source", "tree_nodes", "composite")


def write_outputs(out: Path, rows: list[dict[str, Any]], ec: EvaluateConfig, model_name: str,
                  environment: dict[str, Any], command: str | None, export_dir: str | None,
                  skipped: list[dict[str, Any]] | None = None,
                  divergences: dict[str, Any] | None = None, threads: dict[str, int | None] | None = None,
                  load_average: dict[str, list[float]] | None = None,
                  resolved: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """summary.json, summary.md, summary_details.json and the plots from ``rows``; returns the summary.

    ``skipped``: prompt turns left out because they do not fit the context, listed as ``skipped_prompts`` in
    summary.json when there are any; ``divergences``: :func:`divergence_report`'s (greedy runs); ``threads``: each
    decoder's compute threads (``compute_threads`` of its summary row); ``load_average``: the machine's 1, 5 and
    15-minute load averages before and after the timed decoding (``os.getloadavg``); ``resolved``: what each
    decoder's builder resolved (``BuiltDecoder.info``): the tree a decoder read from the export is named in the
    recommendation's settings (:data:`RESOLVED_KEYS`), so it says which tree to deploy, not only ``null``."""
    extra = {key: environment[key] for key in ("precision", "cpu_kernels") if key in environment}
    if divergences is not None:
        extra["divergences"] = divergences
    summary = summarize(rows, ec.greedy, model_name, environment["device"], environment["dtype"],
                        ec.max_new_tokens, baseline=BASELINE, runtime=extra)
    if skipped:
        summary["skipped_prompts"] = skipped
    if load_average is not None:
        summary["load_average"] = load_average
    by_category = tables_by_category(rows, ec.greedy, baseline=BASELINE)
    for table in (summary["decoders"], by_category[OVERALL]):
        for name, metrics in table.items():
            metrics["compute_threads"] = (threads or {}).get(name)
    if summary["decoders"]:
        overall = summary["decoders"]
        settings = {name: {**dataclasses.asdict(ec.settings_for(name)),
                           **{k: v for k, v in ((resolved or {}).get(name) or {}).items() if k in RESOLVED_KEYS}}
                    for name in overall}
        taus = {n: m["mean_accepted_tokens"] for n, m in overall.items()}
        exact = {n: m["exact_match_vs_greedy"] for n, m in overall.items()}
        summary["recommendation"] = recommend(candidates_from_rows(rows, BASELINE, settings, taus, exact))
        summary["recommendation"]["engines"] = engine_recommendations(rows, list(overall), settings, taus, exact)
    histogram = accepted_length_histogram(rows)
    times = step_times(rows)
    write_json(out / SUMMARY_FILE, summary)
    write_json(out / DETAILS_FILE, {"by_category": by_category,
                                    "accepted_length_histogram": {n: {str(k): v for k, v in h.items()}
                                                                  for n, h in histogram.items()},
                                    "step_times": times})
    text = summary_markdown(summary, by_category, command, environment.get("git_commit"), times)
    atomic_write_text(out / SUMMARY_MD, text)
    if ec.plots:
        head_accuracy = read_tree_files(export_dir).get("head_accuracy") if export_dir else None
        write_plots(out, by_category, histogram, head_accuracy)
    print(text)
    return summary


__all__ = ["decoder_identities", "divergence_report", "engine_recommendations", "evaluate", "load_eval_prompts",
           "open_results", "resolved_config", "result_settings", "supersede_stale_rows", "write_outputs"]
