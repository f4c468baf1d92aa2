"""One ``medusa-eval`` run: check the settings, load the prompts and the export, build the decoders, measure, write.

Files in the output folder:

- ``run.json``: the resolved config, the command-line overrides and command, the environment (device, dtype,
  torch threads, versions, git commit), what each decoder resolved (e.g. the Medusa tree and its source).
- ``results.jsonl``: one row per (prompt, turn, decoder) (:mod:`inference.evaluation.results`).
- ``summary.json`` (DESIGN.md's fields), ``summary.md`` (a table per category and overall),
  ``summary_details.json`` (the same tables by category and the accepted-length histogram), PNG plots.

A rerun with the same settings in the same folder resumes: finished rows are kept, the rest measured; more prompts or
turns extend the run (:data:`~inference.evaluation.config.RESUMABLE_KEYS`). A rerun with other settings is refused
(``overwrite=true`` starts over). The summary covers the current prompt selection.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from inference.decoders.chat import eos_ids
from inference.evaluation.config import BASELINE, RESUMABLE_KEYS, EvaluateConfig
from inference.evaluation.environment import describe_environment
from inference.evaluation.plots import write_plots
from inference.evaluation.results import RESULTS_FILE, ResultsLog
from inference.evaluation.runner import evaluate_prompts
from inference.evaluation.summary import accepted_length_histogram, summarize, summary_markdown, tables_by_category
from inference.evaluation.sweep import RUN_FILE, SUMMARY_FILE
from inference.registry import BuildContext, build_decoder
from medusa_train.config import as_dataclass
from medusa_train.export.files import write_json
from medusa_train.loading.medusa import ORIGINAL_BASE_KEY, export_base_config, load_medusa, model_config_for_export
from medusa_train.prompts import PROMPT_SOURCES, Prompt, load_prompts
from medusa_train.tuning.tune import read_tree_files

log = logging.getLogger(__name__)

SUMMARY_MD = "summary.md"
DETAILS_FILE = "summary_details.json"


def load_eval_prompts(ec: EvaluateConfig) -> list[Prompt]:
    """The prompt set ``ec.prompts`` names (a source name or a JSONL file): ``prompt_offset`` skipped, then the first
    ``per_category`` of each category, then the first ``num_prompts``.

    Raises:
        FileNotFoundError / ValueError: as :func:`medusa_train.prompts.load_prompts` (a malformed line's number).
    """
    source, path = (ec.prompts, None) if ec.prompts in PROMPT_SOURCES else ("jsonl", ec.prompts)
    if ec.per_category is None or source == "sharegpt":  # ShareGPT prompts form one category
        return load_prompts(source, path, ec.prompt_offset, ec.num_prompts)
    taken: dict[str, int] = {}
    prompts = []
    for prompt in load_prompts(source, path, ec.prompt_offset):
        if taken.get(prompt.category, 0) < ec.per_category:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            prompts.append(prompt)
    return prompts[: ec.num_prompts] if ec.num_prompts else prompts


def resolved_config(cfg: DictConfig | EvaluateConfig) -> dict[str, Any]:
    """The run's settings as plain data (interpolations resolved, Hydra's own node left out)."""
    if isinstance(cfg, EvaluateConfig):
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    return data


def result_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings every row of a run shares: :data:`RESUMABLE_KEYS` left out, and the settings of decoders that
    do not run."""
    shared = {k: v for k, v in config.items() if k not in RESUMABLE_KEYS}
    running = [BASELINE] + [n for n in shared.get("decoders", []) if n != BASELINE]  # as EvaluateConfig.run_order
    shared["decoders"] = running
    shared["decoder"] = {k: v for k, v in (shared.get("decoder") or {}).items() if k in running}
    return shared


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def open_results(out_dir: Path, config: dict[str, Any], overwrite: bool) -> ResultsLog:
    """The run's results log, resumed when ``out_dir`` holds a run with the same settings.

    Raises:
        ValueError: ``out_dir`` holds results of other settings (the differences listed) or results without
            their ``run.json``; ``overwrite=true`` discards them instead.
    """
    results_path, run_path = out_dir / RESULTS_FILE, out_dir / RUN_FILE
    if overwrite:
        results_path.unlink(missing_ok=True)
        return ResultsLog(results_path)
    if results_path.is_file():
        if not run_path.is_file():
            raise ValueError(f"{results_path} exists without its {RUN_FILE}: cannot tell which settings made it; "
                             "choose another output_dir or pass overwrite=true")
        previous = result_settings(json.loads(run_path.read_text()).get("config", {}))
        diffs = _differences(previous, result_settings(config))
        if diffs:
            raise ValueError(f"{out_dir} holds results of other settings ({'; '.join(diffs)}); choose another "
                             "output_dir, or pass overwrite=true to discard them")
    results = ResultsLog(results_path)
    if len(results):
        log.info("resuming %s: %d rows already measured are kept", results_path, len(results))
    return results


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
            results of other settings in the folder: all before a model is loaded. An export without heads:
            before the base model is loaded.
    """
    ec: EvaluateConfig = as_dataclass(EvaluateConfig, cfg)  # validates names and every decoder's settings
    hydra_dir, hydra_overrides = _hydra_runtime()
    out = Path(output_dir or hydra_dir or ec.output_dir)
    overrides = hydra_overrides if overrides is None else overrides
    order = ec.run_order()
    if BASELINE not in ec.decoders:
        log.info("adding %s: it is the baseline of speedup and exact match", BASELINE)
    settings = {name: ec.settings_for(name) for name in order}
    prompts = load_eval_prompts(ec)
    config = resolved_config(cfg)
    out.mkdir(parents=True, exist_ok=True)
    results = open_results(out, config, ec.overwrite)

    if ec.threads is not None:
        torch.set_num_threads(ec.threads)
    model, tokenizer, export_config = load_medusa(ec.export_dir, model=ec.model, dtype=ec.dtype, device=ec.device)
    ctx = BuildContext(model=model, tokenizer=tokenizer, export_dir=ec.export_dir, dtype=ec.dtype, device=ec.device,
                       model_config=export_base_config(ec.export_dir, export_config, ec.model, ec.dtype, ec.device))
    built: dict[str, Any] = {}
    try:
        for name in order:
            built[name] = build_decoder(name, settings[name], ctx)
        return _run(ec, out, overrides, prompts, config, results, model, tokenizer, export_config, built)
    finally:
        for b in built.values():  # engines in other processes (vLLM) stop with the run
            close = getattr(b.decoder, "close", None)
            if close is not None:
                close()


def _run(ec: EvaluateConfig, out: Path, overrides: list[str], prompts: list[Prompt], config: dict[str, Any],
         results: ResultsLog, model: Any, tokenizer: Any, export_config: dict[str, Any], built: dict[str, Any]
         ) -> dict[str, Any]:
    """Measure the built decoders on ``prompts`` and write the run's files (the second half of :func:`evaluate`)."""
    environment = describe_environment(model)
    # A Medusa-2 export records its fine-tuned base as "base" (inside it): name the model it was made from.
    model_name = export_config.get(ORIGINAL_BASE_KEY, export_config.get("base_model_name_or_path")) \
        if ec.model is None else model_config_for_export(export_config, ec.model).name_or_path
    command = " ".join(["medusa-eval", *overrides]) if overrides else None
    write_json(out / RUN_FILE, {"config": config, "overrides": overrides, "command": command,
                                "environment": environment, "model": model_name,
                                "decoders": {name: b.info for name, b in built.items()},
                                "resumed_rows": len(results)})

    request = ec.request(eos_ids(tokenizer, getattr(model.base, "generation_config", None)))
    rows = evaluate_prompts({name: b.decoder for name, b in built.items()}, tokenizer, prompts, request, results,
                            baseline=BASELINE, max_turns=ec.max_turns, warmup=ec.warmup,
                            warmup_max_new_tokens=ec.warmup_max_new_tokens, progress=ec.progress)
    return write_outputs(out, rows, ec, model_name, environment, command, export_dir=ec.export_dir)


def write_outputs(out: Path, rows: list[dict[str, Any]], ec: EvaluateConfig, model_name: str,
                  environment: dict[str, Any], command: str | None, export_dir: str | None) -> dict[str, Any]:
    """summary.json, summary.md, summary_details.json and the plots from ``rows``; returns the summary."""
    summary = summarize(rows, ec.greedy, model_name, environment["device"], environment["dtype"],
                        ec.max_new_tokens, baseline=BASELINE)
    by_category = tables_by_category(rows, ec.greedy, baseline=BASELINE)
    histogram = accepted_length_histogram(rows)
    write_json(out / SUMMARY_FILE, summary)
    write_json(out / DETAILS_FILE, {"by_category": by_category,
                                    "accepted_length_histogram": {n: {str(k): v for k, v in h.items()}
                                                                  for n, h in histogram.items()}})
    text = summary_markdown(summary, by_category, command, environment.get("git_commit"))
    (out / SUMMARY_MD).write_text(text)
    if ec.plots:
        head_accuracy = read_tree_files(export_dir).get("head_accuracy") if export_dir else None
        write_plots(out, by_category, histogram, head_accuracy)
    print(text)
    return summary


__all__ = ["evaluate", "load_eval_prompts", "open_results", "resolved_config", "result_settings", "write_outputs"]
