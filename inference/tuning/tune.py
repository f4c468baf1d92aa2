"""Tune the tree for an export: head accuracy on held-out prompts, latency on this device, search, write files."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from inference.tuning.accuracy import measure_head_accuracy
from inference.tuning.composite import composite_shortlist, tune_composite
from inference.tuning.dynamic import prefer_faster_kind, tune_dynamic_tree
from inference.tuning.latency import check_profile_runtime, measure_verification_latency
from inference.tuning.search import best_tree_for_latency, check_accuracy_table, expected_accept_length, greedy_tree
from inference.tuning.timed import choose, describe_choice, shortlist, time_trees
from inference.tuning.tune_tree_config import TuneTreeConfig
from medusa_train.models.catalog import grows_dynamic_trees
from medusa_train.export.files import write_json
from medusa_train.export.tree_files import (
    ACCURACY_FILE,
    CHOICES_FILE,
    COMPOSITE_FILE,
    DYNAMIC_TREE_FILE,
    LATENCY_FILE,
    read_latency_profile,
)
from medusa_train.models.generation import max_positions, pad_token_id_of
from medusa_train.models.speculative import SpeculativeModel
from medusa_train.chat.prompts import Prompt, encode_prompt

log = logging.getLogger(__name__)

def tune_tree(model: SpeculativeModel, tokenizer: Any, prompts: list[Prompt], cfg: TuneTreeConfig,
              runtime: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure, search, and write ``medusa_choices.json``, ``head_accuracy.json``, ``latency_profile.json``,
    ``composite_tree.json`` (unless ``composite=false``), and for
    drafters that grow an EAGLE-2 dynamic tree (:func:`~medusa_train.models.catalog.grows_dynamic_trees`)
    ``dynamic_tree.json``: its shape chosen by decoding (:mod:`inference.tuning.dynamic`; no accuracy table
    needed).

    The caller holds ``cfg.export_dir``'s lock (:data:`~medusa_train.runs.run_lock.EXPORT_LOCK`), as ``medusa-tune-tree``
    does from before the model loads: nothing else writes the folder, or times trees on it, meanwhile.

    ``runtime``: how the model was loaded (:meth:`~medusa_train.loading.runtime.InferenceRuntime.record`: the dtype
    decision with its reason and the CPU's ISA flags, the linear kernels), recorded in ``latency_profile.json``.

    Returns:
        ``{"medusa_choices", "expected_accept_length", "replayed_accept_length", "head_accuracy",
        "latency_profile", "rates", "chosen", "dynamic_tree", "composite_tree"}``: the two τ predictions of the chosen
        tree, by the formula (:func:`~inference.tuning.search.expected_accept_length`) and replayed on the tuning
        prompts
        (:func:`~inference.tuning.replay.replayed_accept_length`, what the decoder measures on them); ``chosen``:
        how the size was chosen (``by``: ``timed``, the shortlist decoded on ``timed_prompts`` tuning prompts and
        the fastest kept when it beats the predicted best beyond the noise, ``margin`` its speed over the predicted
        best's with the interval, :func:`inference.tuning.timed.choose`; or ``predicted``), the predicted best's
        nodes, and the timing (also in ``latency_profile.json``); ``dynamic_tree``: what ``dynamic_tree.json``
        holds (:func:`~inference.tuning.dynamic.tune_dynamic_tree`), None for drafters of static trees only;
        ``composite_tree``: what ``composite_tree.json`` holds (:func:`~inference.tuning.composite.tune_composite`:
        the heads' candidates and prompt lookup's in one tree, the budget split chosen by decoding), None with
        ``composite=false``.
    """
    cfg.validate()
    cfg.check_context(max_positions(model.base.config))  # before the accuracy pass, not after it
    reused = None
    if cfg.latency_from is not None:  # refused before the head accuracy is measured, if made for another runtime
        reused = read_latency_profile(cfg.latency_from)
        check_profile_runtime(reused, model.base, cfg.latency_from,
                              kernels=((runtime or {}).get("cpu_kernels") or {}).get("kernels"))
        reused["measured_for"] = str(cfg.latency_from)
    grid = None
    if grows_dynamic_trees(model):  # its grid checked before the accuracy pass too
        vocab = model.heads.spec.out_size
        for i, k in enumerate(cfg.dynamic_topks):
            if k > vocab:
                raise ValueError(f"dynamic_topks[{i}] = {k} exceeds the drafter's vocabulary of {vocab}; lower it")
        _, reference, shapes = cfg.check_dynamic_grid(reused["latency_ms"] if reused else cfg.latency_sizes)
        grid = reference, shapes
    token_prompts = [encode_prompt(tokenizer, p.first_turn_messages()) for p in prompts]
    accuracy = measure_head_accuracy(model, token_prompts, max_new_tokens=cfg.max_new_tokens, topk=cfg.topk,
                                     eos_token_id=tokenizer.eos_token_id, batch_size=cfg.generation_batch_size,
                                     pad_token_id=pad_token_id_of(tokenizer))
    check_accuracy_table(accuracy["acc"], num_heads=model.heads.spec.num_heads)
    latency = reused if reused is not None else measure_verification_latency(
        model.base, sizes=cfg.latency_sizes, context_length=cfg.context_length, repeats=cfg.repeats)
    choices, rates = best_tree_for_latency(accuracy["acc"], latency["latency_ms"], max_nodes=cfg.max_nodes,
                                           target_ranks=accuracy["target_ranks"])
    predicted_nodes, timed, margin = len(choices), None, None
    timed_prompts = token_prompts[: cfg.timed_prompts]
    if timed_prompts:
        sizes = sorted({*shortlist(rates, sorted(latency["latency_ms"])), predicted_nodes + 1})  # the prediction too
        tree = greedy_tree(accuracy["acc"], max(sizes) - 1)  # every prefix is the best tree of its size
        timed = time_trees(model, timed_prompts, {n: tree[: n - 1] for n in sizes},
                           max_new_tokens=cfg.timed_new_tokens)
        kept, margin = choose(timed, predicted_nodes + 1)
        choices = tree[: kept - 1]
        log.info("decoded %d tuning prompts with trees of %s nodes: kept %d (the latency profile's best: %d; %s)",
                 len(timed_prompts), ", ".join(str(n - 1) for n in sorted(timed)), len(choices), predicted_nodes,
                 describe_choice(margin))
    dynamic = None
    if grid is not None:
        dynamic = tune_dynamic_tree(model, timed_prompts, *grid, max_new_tokens=cfg.timed_new_tokens)
        if timed is not None:
            prefer_faster_kind(dynamic, timed[len(choices) + 1], len(choices))
    composite = None
    if cfg.composite:
        reference, splits = composite_shortlist(len(choices), cfg.composite_heads, cfg.composite_lengths,
                                                cfg.composite_matches, cfg.max_nodes)
        composite = tune_composite(model, timed_prompts, accuracy["acc"], reference, splits,
                                   max_new_tokens=cfg.timed_new_tokens, topk=cfg.topk)
    expected = expected_accept_length(accuracy["acc"], choices)
    replayed = rates[len(choices) + 1]["replayed_tokens"]
    out = Path(cfg.export_dir)
    accuracy["prompt_source"] = cfg.prompts.source
    write_json(out / ACCURACY_FILE, accuracy)
    chosen = {"predicted_nodes": predicted_nodes, "nodes": len(choices),
              "by": "timed" if timed is not None else "predicted"}
    if timed is not None:
        chosen["timed"] = {str(k): v for k, v in timed.items()}
        chosen["timed_prompts"] = len(timed_prompts)
        chosen["timed_new_tokens"] = cfg.timed_new_tokens
        chosen["margin"] = margin  # the fastest timed over the predicted best, with its interval (None: the same)
    write_json(out / LATENCY_FILE, {**latency, "latency_ms": {str(k): v for k, v in latency["latency_ms"].items()},
                                    "predicted": {str(k): v for k, v in rates.items()}, "chosen": chosen,
                                    **(runtime or {})})
    write_json(out / CHOICES_FILE, choices)
    if dynamic is not None:
        write_json(out / DYNAMIC_TREE_FILE, dynamic)
    if composite is not None:
        write_json(out / COMPOSITE_FILE, composite)
    log.info("tree of %d nodes, mean accepted tokens: %.3f replayed on the prompts' continuations, %.3f by the "
             "independent-heads formula", len(choices), replayed, expected)
    return {"medusa_choices": choices, "expected_accept_length": expected, "replayed_accept_length": replayed,
            "head_accuracy": accuracy, "latency_profile": latency, "rates": rates, "chosen": chosen,
            "dynamic_tree": dynamic, "composite_tree": composite}

