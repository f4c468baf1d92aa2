"""medusa-eval on a tiny export: summary numbers recomputed from results.jsonl, resuming, bad input, sweeps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from inference.cli.evaluate import register_schemas
from inference.decoders.tree import TreeDecoder
from inference.decoders.vanilla import VanillaDecoder
from inference.evaluation.eval_run import evaluate
from inference.evaluation.results import read_rows
from inference.evaluation.sweep import concerns, find_runs, sweep_candidates, sweep_markdown, write_sweep
from inference.registry import REGISTRY, decoder_settings, default_decoder_names
from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from medusa_train.chat.prompts import encode_prompt
from tests.conftest import make_tiny_model, make_tiny_tokenizer

register_schemas()  # what conf/evaluate.yaml composes from

TREE = [[0], [0, 0], [1], [0, 1]]
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["write a poem", "now make it rhyme"]},
    {"question_id": 82, "category": "writing", "turns": ["tell me a story", "shorter please"]},
    {"question_id": 101, "category": "math", "turns": ["what is 2+2?", "and 3+3?"]},
]
DESIGN_FIELDS = {"tokens_per_second", "speedup", "speedup_interval", "baseline", "mean_accepted_tokens",
                 "exact_match_vs_greedy", "new_tokens", "wall_time_s"}


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny Llama with 2 heads whose residual blocks are random (so drafts are sometimes rejected), a tuned tree
    and a head-accuracy table."""
    root = tmp_path_factory.mktemp("eval")
    base = make_tiny_model("llama")
    base.save_pretrained(root / "base")
    make_tiny_tokenizer().save_pretrained(root / "base")
    heads = new_heads_for(base, num_heads=2)
    with torch.no_grad():
        heads.block_weight.copy_(torch.randn(heads.block_weight.shape, generator=torch.Generator().manual_seed(0)))
    save_export(heads, root / "export", str(root / "base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(root / "base"))))
    (root / "export" / "medusa_choices.json").write_text(json.dumps(TREE))
    (root / "export" / "head_accuracy.json").write_text(json.dumps({"acc": [[0.5, 0.2], [0.3, 0.1]], "topk": 2}))
    return root / "export"


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Runs here use threads=1 (tiny models are fastest on one thread); restore the session's setting after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def config(export: Path, prompts: Path, out: Path, *extra: str):
    # float32 unless a test asks otherwise: dtype=auto would be bf16 on some CPUs and fp32 on others
    dtype = [] if any(e.startswith("dtype=") for e in extra) else ["dtype=float32"]
    overrides = [f"export_dir={export}", f"prompts={prompts}", f"output_dir={out}", "decoders=[vanilla,tree]",
                 "max_new_tokens=10", "progress=false", "warmup=0", "plots=false", "threads=1", *dtype, *extra]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=overrides)


class CallCounter:
    """Counts ``generate`` calls per decoder class, optionally raising on the n-th call of one (a killed run)."""

    def __init__(self, monkeypatch, fail_class=None, fail_on: int = 0) -> None:
        self.calls = {"vanilla": 0, "tree": 0}
        for cls in (VanillaDecoder, TreeDecoder):
            original = cls.generate

            def counted(decoder, *args, _original=original, _cls=cls, **kwargs):
                self.calls[decoder.name] += 1
                if _cls is fail_class and self.calls[decoder.name] == fail_on:
                    raise KeyboardInterrupt("killed")
                return _original(decoder, *args, **kwargs)

            monkeypatch.setattr(cls, "generate", counted)


def test_summary_matches_results_rows(export, prompts, tmp_path):
    out = tmp_path / "run"
    summary = evaluate(config(export, prompts, out, "warmup=1", "plots=true"))
    rows = read_rows(out / "results.jsonl")
    # 3 prompts x 2 turns x 2 decoders, interleaved: each prompt turn runs vanilla then tree
    assert [(r["prompt_id"], r["turn"], r["decoder"]) for r in rows] == [
        (str(q["question_id"]), t, d) for q in QUESTIONS for t in (1, 2) for d in ("vanilla", "tree")]
    assert json.loads((out / "summary.json").read_text()) == summary
    # summarize()'s fields, then how the run chose its dtype and kernels, why replies left vanilla's (none here) and
    # what to deploy
    assert set(summary) == {"model", "device", "dtype", "prompts", "max_new_tokens", "decoders", "precision",
                            "cpu_kernels", "divergences", "recommendation", "load_average"}
    assert all(len(summary["load_average"][k]) == 3 for k in ("before", "after"))
    assert summary["prompts"] == 3 and summary["max_new_tokens"] == 10 and summary["dtype"] == "float32"
    assert list(summary["decoders"]) == ["vanilla", "tree"]
    tps = {}
    for name, metrics in summary["decoders"].items():
        mine = [r for r in rows if r["decoder"] == name]
        assert set(metrics) == DESIGN_FIELDS | {"compute_threads"}
        assert metrics["compute_threads"] == 1  # threads=1: every decoder of ours on one
        assert metrics["baseline"] == "vanilla"  # our decoders: speedup over plain decoding in ours
        assert metrics["new_tokens"] == sum(r["new_tokens"] for r in mine)
        assert metrics["wall_time_s"] == pytest.approx(sum(r["wall_time_s"] for r in mine))
        tps[name] = sum(r["new_tokens"] for r in mine) / sum(r["wall_time_s"] for r in mine)
        assert metrics["tokens_per_second"] == pytest.approx(tps[name])
        # tau: tokens of the decoding passes (all but the prefill's) / decoding passes (base.py's convention)
        assert all(r["new_tokens"] == 1 + sum(r["accepted_lengths"]) for r in mine)
        tau = sum(r["new_tokens"] - 1 for r in mine) / sum(r["forward_passes"] for r in mine)
        assert metrics["mean_accepted_tokens"] == pytest.approx(tau)
        assert metrics["speedup"] == pytest.approx(tps[name] / tps["vanilla"])
        interval = metrics["speedup_interval"]  # paired over the 6 prompt turns
        assert interval["turns"] == 6 and interval["estimate"] == pytest.approx(metrics["speedup"])
        assert interval["low"] <= metrics["speedup"] <= interval["high"]
        assert interval["separated"] == (interval["low"] > 1 or interval["high"] < 1)
    vanilla, tree = summary["decoders"]["vanilla"], summary["decoders"]["tree"]
    assert vanilla["speedup_interval"]["low"] == vanilla["speedup_interval"]["high"] == 1.0
    chosen = summary["recommendation"]["overall"]  # the faster of the two, the other its runner-up
    fastest = max(tps, key=tps.get)
    assert chosen["deploy"] == fastest and chosen["runner_up"] == min(tps, key=tps.get)
    assert chosen["speedup"] == pytest.approx(summary["decoders"][fastest]["speedup"])
    assert chosen["margin"]["estimate"] == pytest.approx(max(tps.values()) / min(tps.values()))
    assert f"deploy **{fastest}**" in (out / "summary.md").read_text()
    # the tree is named as the builder resolved it (tree_source, its nodes), not only as the config's null
    run_info = json.loads((out / "run.json").read_text())["decoders"][fastest]
    resolved = {k: run_info[k] for k in ("tree_source", "tree_nodes") if k in run_info}
    assert resolved == ({} if fastest == "vanilla" else {"tree_source": "export medusa_choices.json",
                                                           "tree_nodes": resolved.get("tree_nodes")})
    assert {k: chosen["settings"].get(k) for k in resolved} == resolved
    assert vanilla["mean_accepted_tokens"] == 1.0 and vanilla["speedup"] == 1.0
    # greedy Medusa is lossless: the same tokens as vanilla on every prompt turn
    assert vanilla["exact_match_vs_greedy"] == 1.0 and tree["exact_match_vs_greedy"] == 1.0
    assert tree["new_tokens"] == vanilla["new_tokens"]
    assert tree["mean_accepted_tokens"] > 1.0  # some drafts accepted: fewer passes than tokens

    # turn 2 follows vanilla's own first answer, the same prompt for both decoders
    tokenizer = make_tiny_tokenizer()
    for q in QUESTIONS:
        first = next(r for r in rows if r["prompt_id"] == str(q["question_id"]) and r["turn"] == 1
                     and r["decoder"] == "vanilla")
        messages = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": q["turns"][1]}]
        second = [r for r in rows if r["prompt_id"] == str(q["question_id"]) and r["turn"] == 2]
        assert [r["prompt_tokens"] for r in second] == [len(encode_prompt(tokenizer, messages))] * 2

    md = (out / "summary.md").read_text()
    assert "## overall" in md and "## math" in md and "## writing" in md and "| tree |" in md
    details = json.loads((out / "summary_details.json").read_text())
    assert details["by_category"]["overall"] == summary["decoders"]
    math_rows = [r for r in rows if r["category"] == "math" and r["decoder"] == "tree"]
    assert details["by_category"]["math"]["tree"]["new_tokens"] == sum(r["new_tokens"] for r in math_rows)
    histogram = details["accepted_length_histogram"]
    assert histogram["vanilla"] == {"1": sum(r["forward_passes"] for r in rows if r["decoder"] == "vanilla")}
    assert sum(int(k) * v for k, v in histogram["tree"].items()) == tree["new_tokens"] - 6
    for png in ("speedup_by_category.png", "accepted_lengths.png", "head_accuracy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    run = json.loads((out / "run.json").read_text())
    env = run["environment"]
    assert env["dtype"] == "float32" and env["device"].startswith("cpu") and env["torch_threads"] == 1
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["transformers"]
    assert run["config"]["max_new_tokens"] == 10 and run["config"]["decoder"]["tree"]["topk"] == 10
    assert run["decoders"]["tree"]["medusa_choices"] == TREE
    assert run["decoders"]["tree"]["tree_source"] == "export medusa_choices.json"


def test_every_decoder_runs_and_the_lossless_ones_match_vanilla(export, prompts, tmp_path):
    out = tmp_path / "all"
    cfg = config(export, prompts, out, "decoders=[tree,composite,draft,lookahead,hf_assisted,hf_prompt_lookup]",
                 "num_prompts=2", "decoder.draft.num_layers=1", "decoder.hf_assisted.num_layers=1")
    summary = evaluate(cfg)
    assert list(summary["decoders"]) == list(default_decoder_names())  # vanilla added first, then the order asked for
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 2 * 2 * len(default_decoder_names())
    for name, metrics in summary["decoders"].items():
        mine = [r for r in rows if r["decoder"] == name]
        # every decoder here is lossless at temperature 0: token for token vanilla's replies
        assert metrics["exact_match_vs_greedy"] == 1.0, name
        assert metrics["new_tokens"] == summary["decoders"]["vanilla"]["new_tokens"], name
        assert metrics["mean_accepted_tokens"] == pytest.approx(
            sum(sum(r["accepted_lengths"]) for r in mine) / sum(r["forward_passes"] for r in mine)), name
        if not name.startswith("hf_"):  # HF may verify drafts inside its prefill call: those tokens count for no pass
            assert all(r["new_tokens"] == 1 + sum(r["accepted_lengths"]) for r in mine), name
    run = json.loads((out / "run.json").read_text())
    assert run["decoders"]["draft"] == {"draft": "self_layers", "draft_layers": 1}
    assert run["decoders"]["hf_assisted"] == run["decoders"]["draft"]


def test_a_separate_draft_model_is_loaded_once_and_equal_to_the_target_accepts_every_draft(
        export, prompts, tmp_path, monkeypatch):
    import medusa_train.loading.base as loading

    loads = []
    original = loading.load_base_model
    monkeypatch.setattr(loading, "load_base_model", lambda cfg: loads.append(cfg) or original(cfg))
    target = json.loads((export / "config.json").read_text())["base_model_name_or_path"]
    draft = [f"decoder.{name}.{setting}" for name in ("draft", "hf_assisted") for setting in (
        "kind=model", f"model={{name_or_path:'{target}',dtype:float16}}", "num_draft_tokens=3")]
    out = tmp_path / "draft"
    summary = evaluate(config(export, prompts, out, "decoders=[draft,hf_assisted]", "num_prompts=1", "max_turns=1",
                              "dtype=float32", "decoder.hf_assisted.confidence_threshold=0", *draft))
    # one draft for both decoders, in the run's dtype (float32 overrides the draft's float16)
    assert [(c.name_or_path, c.dtype) for c in loads] == [(target, "float32")]
    rows = {r["decoder"]: r for r in read_rows(out / "results.jsonl")}
    assert rows["vanilla"]["stop_reason"] == "max_new_tokens" and rows["vanilla"]["new_tokens"] == 10
    # the draft is the target itself: every step accepts all K = 3 drafts plus the bonus token (9 = 4 + 4 + 1)
    assert rows["draft"]["accepted_lengths"] == [4, 4, 1] and rows["draft"]["tokens"] == rows["vanilla"]["tokens"]
    assert summary["decoders"]["draft"]["mean_accepted_tokens"] == 3.0
    assert rows["hf_assisted"]["tokens"] == rows["vanilla"]["tokens"]


def test_interrupted_run_resumes_without_redoing_rows(export, prompts, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = config(export, prompts, out)
    killed = CallCounter(monkeypatch, fail_class=TreeDecoder, fail_on=3)
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg)
    assert killed.calls == {"vanilla": 3, "tree": 3}
    before = read_rows(out / "results.jsonl")
    assert [(r["prompt_id"], r["turn"], r["decoder"]) for r in before] == [
        ("81", 1, "vanilla"), ("81", 1, "tree"), ("81", 2, "vanilla"), ("81", 2, "tree"), ("82", 1, "vanilla")]
    # the process died while writing the next row: a cut last line is dropped and that row measured again
    with open(out / "results.jsonl", "a") as f:
        f.write('{"prompt_id": "82", "turn": 1, "decoder": "med')

    monkeypatch.undo()
    resumed = CallCounter(monkeypatch)
    evaluate(config(export, prompts, out, "warmup=1"))  # warm-up is not a result setting
    # 12 rows in all, 5 kept: vanilla 6 - 3 + 1 warm-up, tree 6 - 2 + 1 warm-up
    assert resumed.calls == {"vanilla": 4, "tree": 5}
    after = read_rows(out / "results.jsonl")
    assert len(after) == 12 and after[:5] == before
    assert len({(r["prompt_id"], r["turn"], r["decoder"]) for r in after}) == 12
    assert json.loads((out / "summary.json").read_text())["decoders"]["tree"]["exact_match_vs_greedy"] == 1.0

    monkeypatch.undo()
    finished = CallCounter(monkeypatch)
    evaluate(cfg)
    assert finished.calls == {"vanilla": 0, "tree": 0}  # nothing left to do, no warm-up either
    assert read_rows(out / "results.jsonl") == after


def test_more_prompts_extend_a_run_other_settings_are_refused(export, prompts, tmp_path, monkeypatch):
    out = tmp_path / "run"
    evaluate(config(export, prompts, out, "num_prompts=1", "max_turns=1"))
    first = read_rows(out / "results.jsonl")
    assert len(first) == 2
    counter = CallCounter(monkeypatch)
    summary = evaluate(config(export, prompts, out, "num_prompts=2"))
    # kept: prompt 81 turn 1; measured: 81 turn 2, 82 turns 1 and 2, by both decoders
    assert counter.calls == {"vanilla": 3, "tree": 3}
    rows = read_rows(out / "results.jsonl")
    assert rows[:2] == first and len(rows) == 8 and summary["prompts"] == 2
    vanilla_rows = [r for r in rows if r["decoder"] == "vanilla"]
    assert summary["decoders"]["vanilla"]["new_tokens"] == sum(r["new_tokens"] for r in vanilla_rows)

    with pytest.raises(ValueError, match=r"max_new_tokens: 10 -> 8.*overwrite=true"):
        evaluate(config(tmp_path / "nowhere", prompts, out, "max_new_tokens=8"))
    with pytest.raises(ValueError, match=r"decoders: \['vanilla', 'tree'\] -> \['vanilla', 'lookahead'\]"):
        evaluate(config(tmp_path / "nowhere", prompts, out, "decoders=[vanilla,lookahead]"))
    monkeypatch.undo()
    counter = CallCounter(monkeypatch)
    evaluate(config(export, prompts, out, "num_prompts=1", "max_turns=1", "max_new_tokens=8", "overwrite=true"))
    assert counter.calls == {"vanilla": 1, "tree": 1}
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 2 and all(r["new_tokens"] == 8 for r in rows)


@pytest.mark.parametrize("extra, ids", [
    ([], ["81", "82", "101"]),
    (["per_category=1"], ["81", "101"]),
    (["prompt_offset=1", "per_category=1"], ["82", "101"]),
    (["per_category=2", "num_prompts=2"], ["81", "82"]),
])
def test_prompt_subsets(prompts, tmp_path, extra, ids):
    from inference.evaluation.eval_config import EvaluateConfig
    from inference.evaluation.eval_run import load_eval_prompts
    from medusa_train.config.schema import as_dataclass

    ec = as_dataclass(EvaluateConfig, config(tmp_path, prompts, tmp_path, *extra))
    assert [p.id for p in load_eval_prompts(ec)] == ids


def test_malformed_prompt_file_names_its_line_before_loading(prompts, tmp_path):
    lines = prompts.read_text().splitlines()
    lines[1] = '{"question_id": 82, "turns": ["unterminated'
    prompts.write_text("\n".join(lines) + "\n")
    # the export does not exist: the prompt file is read before any model is loaded
    with pytest.raises(ValueError, match=r"questions\.jsonl:2: not valid JSON"):
        evaluate(config(tmp_path / "no_export", prompts, tmp_path / "out"))


@pytest.mark.parametrize("decoders, match", [
    ("[vanilla,bogus]", r"unknown decoder name\(s\) \['bogus'\]; valid: vanilla, tree"),
    ("[tree,tree]", r"lists \['tree'\] more than once"),
])
def test_bad_decoder_names_are_refused_before_loading(prompts, tmp_path, decoders, match):
    with pytest.raises(ValueError, match=match):
        evaluate(config(tmp_path / "no_export", prompts, tmp_path / "out", f"decoders={decoders}"))
    assert not (tmp_path / "out").exists()


def test_bad_decoder_setting_names_the_decoder(prompts, tmp_path):
    with pytest.raises(ValueError, match=r"decoder\.tree: acceptance must be one of"):
        evaluate(config(tmp_path / "no_export", prompts, tmp_path / "out", "decoder.tree.acceptance=best"))
    with pytest.raises(ValueError, match=r"decoder\.tree: .*bogus"):
        decoder_settings("tree", {"bogus": 1})


@pytest.mark.parametrize("extra, match", [
    (["decoder.draft.kind=model"], r"decoder\.draft: .*needs draft\.model"),
    (["temperature=0.7"], r"decoder 'lookahead' decodes greedily only"),
    (["temperature=0.7", "decoders=[tree]", "decoder.tree.acceptance=greedy"],
     r"decoder\.tree\.acceptance=greedy needs temperature=0"),
])
def test_decoders_that_cannot_run_are_named_before_loading(prompts, tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        evaluate(config(tmp_path / "no_export", prompts, tmp_path / "out", "decoders=[draft,lookahead]", *extra))


def test_export_without_heads_is_refused(export, prompts, tmp_path):
    headless = tmp_path / "headless"
    headless.mkdir()
    (headless / "config.json").write_text((export / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no medusa_lm_head\.safetensors"):
        evaluate(config(headless, prompts, tmp_path / "out"))


def test_decoder_yaml_files_hold_the_schema_defaults(tmp_path):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["export_dir=x", f"output_dir={tmp_path}"])
    assert sorted(cfg.decoder) == sorted(REGISTRY) and list(cfg.decoders) == list(default_decoder_names())
    assert sorted(set(REGISTRY) - set(cfg.decoders)) == ["llamacpp", "llamacpp_draft", "llamacpp_eagle3",
                                                         "llamacpp_ngram", "medusa", "vllm", "vllm_draft",
                                                         "vllm_eagle3", "vllm_medusa", "vllm_ngram"]  # when listed
    # medusa: tree's old name (medusa_train.config.renames)
    for name, entry in REGISTRY.items():
        assert OmegaConf.to_object(cfg.decoder[name]) == entry.settings(), name
    from inference.evaluation.eval_config import EvaluateConfig

    composed = OmegaConf.to_object(cfg)
    composed.decoder = {}
    assert composed == EvaluateConfig(export_dir="x", output_dir=str(tmp_path))


def test_sweep_combines_runs_into_one_table(export, prompts, tmp_path):
    summaries = {}
    for topk in (2, 4):
        out = tmp_path / "sweep" / str(topk // 2 - 1)
        summaries[topk] = evaluate(config(export, prompts, out, "num_prompts=1", "max_turns=1",
                                          f"decoder.tree.topk={topk}"),
                                   overrides=["max_turns=1", f"decoder.tree.topk={topk}"])
    runs = find_runs([tmp_path / "sweep"])
    assert [r.name for r in runs] == ["0", "1"]
    path, rows = write_sweep(tmp_path / "sweep", runs)
    assert [(r["decoder"], r["overrides"]["decoder.tree.topk"]) for r in rows] == [("tree", "2"), ("tree", "4")]
    for row, topk in zip(rows, (2, 4)):
        tree = summaries[topk]["decoders"]["tree"]
        assert row["speedup"] == tree["speedup"] and row["mean_accepted_tokens"] == tree["mean_accepted_tokens"]
        assert row["baseline_tokens_per_second"] == summaries[topk]["decoders"]["vanilla"]["tokens_per_second"]
    table = path.read_text()
    assert table.startswith(sweep_markdown(rows)) and "## Recommendation" in table
    assert "Shared overrides: `max_turns=1`" in table
    assert "| run | decoder.tree.topk | decoder |" in table
    assert len([line for line in table.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]) == 2
    assert len((tmp_path / "sweep" / "sweep.jsonl").read_text().splitlines()) == 2
    assert [(c.label, c.settings.get("decoder.tree.topk")) for c in sweep_candidates(runs)] == [
        ("vanilla", None), ("tree (decoder.tree.topk=2)", "2"), ("tree (decoder.tree.topk=4)", "4")]


@pytest.mark.parametrize("key,decoder,expected", [
    ("decoder.llamacpp_eagle3.draft_max", "llamacpp", False),  # another decoder's own setting
    ("decoder.llamacpp_eagle3.draft_max", "llamacpp_eagle3", True),
    ("dtype", "llamacpp", True), ("decoder", "tree", True), ("export_dir", "vanilla", True)])
def test_a_sweep_labels_a_decoder_only_with_the_overrides_that_can_change_it(key, decoder, expected):
    assert concerns(key, decoder) is expected


@pytest.mark.slow
def test_hydra_multirun_writes_one_table(export, prompts, tmp_path, monkeypatch):
    from inference.cli.evaluate import main

    out = tmp_path / "multirun"
    monkeypatch.setattr(sys, "argv", [
        "medusa-eval", "-m", f"export_dir={export}", f"prompts={prompts}", f"output_dir={out}", "decoders=[tree]",
        "max_new_tokens=6", "num_prompts=1", "max_turns=1", "progress=false", "warmup=0", "plots=false", "threads=1",
        "dtype=float32", "decoder.tree.topk=2,3", "hydra/job_logging=none", "hydra/hydra_logging=none"])
    main()
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [(r["decoder"], r["overrides"]["decoder.tree.topk"]) for r in rows] == [("tree", "2"), ("tree", "3")]
    for job in ("0", "1"):
        summary = json.loads((out / job / "summary.json").read_text())
        assert list(summary["decoders"]) == ["vanilla", "tree"]  # the baseline joins a sweep of one decoder
        assert json.loads((out / job / "run.json").read_text())["command"].startswith("medusa-eval ")


def test_a_damaged_results_line_is_named(tmp_path):
    from inference.evaluation.results import ResultsLog

    path = tmp_path / "results.jsonl"
    row = {"prompt_id": "1", "turn": 1, "decoder": "vanilla"}
    path.write_text(json.dumps(row) + "\n{oops\n" + json.dumps({**row, "turn": 2}) + "\n")
    with pytest.raises(ValueError, match=r"results\.jsonl:2: not a results row.*overwrite=true"):
        ResultsLog(path)
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="two rows for prompt 1 turn 1 decoder vanilla"):
        ResultsLog(path)
    path.write_text(json.dumps(row))  # a complete last row without its newline: kept, and the file repaired
    log = ResultsLog(path)
    log.append({**row, "turn": 2})
    assert [json.loads(line)["turn"] for line in path.read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------- stale rows, drafts too deep, prompts too long


def copy_export(export: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(export, to)
    return to


def test_a_new_tree_or_new_heads_remeasure_only_the_medusa_rows(export, prompts, tmp_path, monkeypatch):
    """medusa-tune-tree rewrote medusa_choices.json (or training rewrote the heads) after a run: a rerun in the same
    folder measures tree again with what it now decodes with, keeps vanilla's rows, and keeps the old rows aside."""
    from medusa_train.export import load_heads

    mine = copy_export(export, tmp_path / "export")
    out = tmp_path / "run"
    evaluate(config(mine, prompts, out, "num_prompts=2"))
    first = read_rows(out / "results.jsonl")
    run = json.loads((out / "run.json").read_text())
    recorded = run["measured_with"]["decoders"]["tree"]
    assert recorded["medusa_choices"] == TREE and len(recorded["heads_sha256"]) == 64
    assert run["measured_with"]["run"]["base_model"]["name_or_path"] == str(export.parent / "base")
    assert run["measured_with"]["run"]["base_model"]["dtype"] == "float32"
    assert {r["measured_with"] for r in first if r["decoder"] == "tree"} == {
        run["measured_with"]["fingerprints"]["tree"]}

    new_tree = [[0], [1], [0, 0]]
    (mine / "medusa_choices.json").write_text(json.dumps(new_tree))
    counter = CallCounter(monkeypatch)
    summary = evaluate(config(mine, prompts, out, "num_prompts=2"))
    assert counter.calls == {"vanilla": 0, "tree": 4}  # 2 prompts x 2 turns, tree only
    rows = read_rows(out / "results.jsonl")
    assert [r for r in rows if r["decoder"] == "vanilla"] == [r for r in first if r["decoder"] == "vanilla"]
    run = json.loads((out / "run.json").read_text())
    assert run["measured_with"]["decoders"]["tree"]["medusa_choices"] == new_tree
    assert run["decoders"]["tree"]["medusa_choices"] == new_tree
    assert "medusa_choices" in run["remeasured"]["tree"]
    superseded = read_rows(out / "results_superseded.jsonl")
    assert len(superseded) == 4 and all("medusa_choices: [[0], [0, 0], [1], [0, 1]] -> [[0], [1], [0, 0]]"
                                        in r["superseded_because"] for r in superseded)
    new_medusa = [r for r in rows if r["decoder"] == "tree"]
    tau = sum(sum(r["accepted_lengths"]) for r in new_medusa) / sum(r["forward_passes"] for r in new_medusa)
    assert summary["decoders"]["tree"]["mean_accepted_tokens"] == pytest.approx(tau)

    # new heads, same tree: the checksum changed, tree is measured again
    heads, _ = load_heads(mine)
    with torch.no_grad():
        heads.block_weight.mul_(0.5)
    record = json.loads((mine / "config.json").read_text())
    save_export(heads, mine, record["base_model_name_or_path"], vllm=False,
                extra_config={"medusa_train_model": record["medusa_train_model"]})
    monkeypatch.undo()
    counter = CallCounter(monkeypatch)
    evaluate(config(mine, prompts, out, "num_prompts=2"))
    assert counter.calls == {"vanilla": 0, "tree": 4}
    assert "heads_sha256" in json.loads((out / "run.json").read_text())["remeasured"]["tree"]
    assert len(read_rows(out / "results_superseded.jsonl")) == 8

    # a tree setting: only tree again; nothing changed: nothing measured
    monkeypatch.undo()
    counter = CallCounter(monkeypatch)
    evaluate(config(mine, prompts, out, "num_prompts=2", "decoder.tree.topk=4"))
    assert counter.calls == {"vanilla": 0, "tree": 4}
    monkeypatch.undo()
    counter = CallCounter(monkeypatch)
    evaluate(config(mine, prompts, out, "num_prompts=2", "decoder.tree.topk=4"))
    assert counter.calls == {"vanilla": 0, "tree": 0}


def test_another_base_model_or_an_unrecorded_run_is_refused_before_loading(export, prompts, tmp_path, monkeypatch):
    import shutil

    import medusa_train.loading.base as loading

    mine = copy_export(export, tmp_path / "export")
    out = tmp_path / "run"
    evaluate(config(mine, prompts, out, "num_prompts=1", "max_turns=1"))
    # the export now records another base model (retrained into the same folder)
    other = tmp_path / "other-base"
    shutil.copytree(Path(json.loads((mine / "config.json").read_text())["base_model_name_or_path"]), other)
    record = json.loads((mine / "config.json").read_text())
    record["medusa_train_model"]["name_or_path"] = record["base_model_name_or_path"] = str(other)
    (mine / "config.json").write_text(json.dumps(record))
    monkeypatch.setattr(loading, "load_base_model", lambda cfg: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match=r"measured on another base model \(base_model\.name_or_path: .*other-base"
                                         r".*overwrite=true"):
        evaluate(config(mine, prompts, out, "num_prompts=1", "max_turns=1"))
    # results of a medusa-train that did not record what they were measured with
    run = json.loads((out / "run.json").read_text())
    del run["measured_with"]
    (out / "run.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"older medusa-train.*overwrite=true"):
        evaluate(config(mine, prompts, out, "num_prompts=1", "max_turns=1"))


def test_a_self_layers_draft_as_deep_as_the_target_is_named_before_decoding(export, prompts, tmp_path, monkeypatch):
    counter = CallCounter(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(ValueError) as info:  # the defaults: num_layers 8 on a 2-layer target
        evaluate(config(export, prompts, out, "decoders=[draft,hf_assisted]"))
    message = str(info.value)
    for name in ("draft", "hf_assisted"):
        assert (f"decoder.{name}.num_layers=8: a self_layers draft keeps fewer layers than the target, which has 2; "
                f"set decoder.{name}.num_layers to at most 1") in message
    assert counter.calls == {"vanilla": 0, "tree": 0} and not (out / "results.jsonl").exists()


def test_medusa_eval_where_no_prompt_fits_fails_instead_of_writing_an_empty_table(export, tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": ["x" * 2100]}) + "\n" for i in (1, 2)))
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"^no prompt fits the context of 2048 positions \(max_position_embeddings="
                                         r"2048\) with max_new_tokens=10, so the run would measure nothing; all 2 left "
                                         r"out: prompt '1' turn 1 \(\d+ tokens; the prompt alone fills the context"):
        evaluate(config(export, prompts, out))
    assert not (out / "summary.json").exists() and not (out / "summary.md").exists()


def test_prompts_that_do_not_fit_the_context_are_left_out_named_and_listed(export, tmp_path, caplog):
    # the tiny tokenizer is one token per character; the tiny Llama has 2048 positions
    template = len(encode_prompt(make_tiny_tokenizer(), [{"role": "user", "content": ""}]))
    questions = [
        {"question_id": 1, "category": "ok", "turns": ["short"]},
        {"question_id": 2, "category": "long", "turns": ["x" * 2100]},                # the prompt alone does not fit
        {"question_id": 3, "category": "long", "turns": ["y" * (2044 - template)]},   # fits max_new_tokens <= 4
        {"question_id": 4, "category": "ok", "turns": ["hi", "z" * 2040]},            # turn 2 does not fit
    ]
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in questions))
    out = tmp_path / "run"
    caplog.set_level("WARNING")
    summary = evaluate(config(export, prompts, out))
    skipped = {(s["prompt_id"], s["turn"]): s for s in summary["skipped_prompts"]}
    assert sorted(skipped) == [("2", 1), ("3", 1), ("4", 2)]
    assert skipped[("2", 1)]["fits_max_new_tokens"] is None and skipped[("2", 1)]["context"] == 2048
    assert skipped[("3", 1)]["prompt_tokens"] == 2044 and skipped[("3", 1)]["fits_max_new_tokens"] == 4
    assert "2 of 4 prompts do not fit the model's context of 2048 positions with max_new_tokens=10" in caplog.text
    assert "prompt '3' turn 1 (2044 tokens; max_new_tokens=4 would fit it)" in caplog.text
    assert "prompt '2' turn 1" in caplog.text and "the prompt alone fills the context: leave it out" in caplog.text
    rows = read_rows(out / "results.jsonl")
    assert sorted({(r["prompt_id"], r["turn"]) for r in rows}) == [("1", 1), ("4", 1)]
    assert summary["prompts"] == 2
    assert json.loads((out / "summary.json").read_text())["skipped_prompts"] == summary["skipped_prompts"]
    assert "Left out, not fitting the model's context" in (out / "summary.md").read_text()


def test_the_context_error_advises_what_fits():
    from inference.decoders.base import check_context

    with pytest.raises(ValueError, match=r"lower max_new_tokens to at most 48 or shorten the prompt"):
        check_context(80, 64, 128)
    with pytest.raises(ValueError, match=r"the prompt alone leaves no room for a reply: shorten it to fewer than 128 "
                                         r"tokens or leave it out"):
        check_context(130, 64, 128)
def test_the_medusa_decoder_runs_hydra_exports_and_every_tree_decoder_reports_its_step_times(export, prompts,
                                                                                            tmp_path):
    """One decoder entry for tree decoding with draft heads: a Hydra export is decoded level by level (lossless), the
    run record names the head type, and summary.md / summary_details.json give drafting and verification per step
    for the tree decoder and nothing for vanilla."""
    base_dir = export.parent / "base"
    base = transformers_model(base_dir)
    hydra = tmp_path / "hydra_export"
    heads = new_heads_for(base, num_heads=2, head_type="hydra")
    with torch.no_grad():
        for layer in (m for head in heads.heads for m in head.layers):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(0)))
    save_export(heads, hydra, str(base_dir), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(base_dir))))
    (hydra / "medusa_choices.json").write_text(json.dumps(TREE))
    out = tmp_path / "run"
    summary = evaluate(config(hydra, prompts, out))
    assert summary["decoders"]["tree"]["exact_match_vs_greedy"] == 1.0
    assert json.loads((out / "run.json").read_text())["decoders"]["tree"]["head_type"] == "hydra"
    rows = read_rows(out / "results.jsonl")
    assert all((r["draft_time_s"] is None) == (r["decoder"] == "vanilla") for r in rows)
    times = json.loads((out / "summary_details.json").read_text())["step_times"]
    assert list(times) == ["tree"]
    passes = sum(r["forward_passes"] for r in rows if r["decoder"] == "tree")
    draft = sum(r["draft_time_s"] for r in rows if r["decoder"] == "tree")
    assert times["tree"]["draft_ms_per_step"] == pytest.approx(1000 * draft / passes)
    assert "| tree |" in (out / "summary.md").read_text().split("## drafting and verification")[1]


def transformers_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def test_an_engines_restart_keeps_its_rows_and_a_changed_setting_does_not():
    from inference.evaluation.provenance import decoder_identity, fingerprint

    settings = {"draft_max": 3}
    first = {"engine": "llama.cpp b1", "engine_log": "/tmp/llama-server-a.log", "engine_start_s": 3.66}
    restarted = {**first, "engine_log": "/tmp/llama-server-b.log", "engine_start_s": 4.24}
    assert fingerprint(decoder_identity(settings, first, None)) == fingerprint(decoder_identity(settings, restarted, None))
    other_engine = {**first, "engine": "llama.cpp b2"}
    assert fingerprint(decoder_identity(settings, first, None)) != fingerprint(decoder_identity(settings, other_engine, None))
    assert fingerprint(decoder_identity(settings, first, None)) != fingerprint(decoder_identity({"draft_max": 4}, first, None))
