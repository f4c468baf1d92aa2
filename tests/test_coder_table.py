"""benchmarks/coder_table.py: the cells (plain and drafters'), what each runs, its rows (each speedup over its own
engine's plain row), the table rendered, a finished cell never run again, and a drafter's recipe run with the 1.5B's
settings, its replies archived once and restored on another machine (the recipe itself is run by the benchmark)."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def table(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("coder_table", REPO_ROOT / "benchmarks" / "coder_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "TABLE", tmp_path / "coder.json")
    monkeypatch.setattr(module, "DOC", tmp_path / "coder.md")
    monkeypatch.setattr(module, "REPLIES", tmp_path / "data" / "coder")
    heads = (tmp_path / "README.md", tmp_path / "results.md")
    for doc in heads:
        doc.write_text(f"# top\n\n{module.HEADLINE_BEGIN}\nold\n{module.HEADLINE_END}\n\nrest\n", encoding="utf-8")
    monkeypatch.setattr(module, "HEADLINE_DOCS", heads)
    return module


def summary(*names: str, baseline: dict | None = None) -> dict:
    def metrics(name: str) -> dict:
        return {"tokens_per_second": 5.0, "speedup": 1.5, "baseline": (baseline or {}).get(name, "vanilla"),
                "speedup_interval": {"low": 1.2, "high": 1.8}, "mean_accepted_tokens": 2.5,
                "exact_match_vs_greedy": 1.0, "new_tokens": 100}
    return {"decoders": {n: metrics(n) for n in names}, "prompts": 20, "dtype": "bfloat16",
            "load_average": {"before": [0.5, 0, 0], "after": [2.1, 0, 0]}}


@pytest.mark.parametrize("text, parsed", [
    ("ours:humaneval", ("ours", "humaneval")), ("vllmngram:spec_bench", ("vllmngram", "spec_bench")),
    ("medusa-1:mt_bench", ("medusa-1", "mt_bench")), ("eagle3-4/llamacpp:humaneval", ("eagle3-4/llamacpp", "humaneval")),
    ("eagle3-1/vllm:humaneval", ("eagle3-1/vllm", "humaneval")), ("hydra-1/fp32:humaneval", ("hydra-1/fp32", "humaneval")),
])
def test_cells_parse(table, text, parsed):
    assert table.parse_cell(text) == parsed


@pytest.mark.parametrize("text, message", [
    ("ours:gsm8k", "SET one of humaneval, mt_bench, spec_bench"), ("lookahead:humaneval", "DRAFTER one of medusa"),
    ("medusa-0:humaneval", "SIZE a positive integer"), ("medusa-1/tgi:humaneval", "ENGINE one of fp32, vllm, llamacpp"),
    ("medusa-1/llamacpp:humaneval", "llama.cpp loads EAGLE-3 drafters only, not medusa"),
    ("hydra-1/vllm:humaneval", "vLLM serves no hydra drafter"),
])
def test_a_bad_cell_is_refused_naming_it(table, text, message):
    with pytest.raises(ValueError, match=message):
        table.parse_cell(text)


def test_what_each_cell_runs(table):
    ours = table.eval_overrides("ours", "humaneval", 20)
    assert ours[:3] == ["model=qwen2_5_coder_1_5b", "draft=qwen2_5_coder_0_5b",
                        "decoders=[vanilla,draft,hf_assisted,hf_prompt_lookup,lookahead]"]
    assert {"prompts=humaneval", "num_prompts=20", "dtype=auto", "max_new_tokens=256",
            "decoder.draft.num_draft_tokens=3"} <= set(ours)
    assert "decoders=[vanilla,llamacpp,llamacpp_draft,llamacpp_ngram]" in table.eval_overrides("llamacpp", "mt_bench", 20)
    assert {"per_category=1", "max_turns=1"} <= set(table.eval_overrides("vllm", "spec_bench", 20))
    eagle3 = table.eval_overrides("eagle3-1/vllm", "humaneval", 20, Path("E"))
    assert eagle3[:2] == ["export_dir=E", "decoders=[vanilla,vllm,vllm_eagle3]"] and "model=qwen2_5_coder_1_5b" not in eagle3
    exact = table.eval_overrides("medusa-1/fp32", "mt_bench", 20, Path("E"))
    assert {"decoders=[vanilla,tree,composite]", "dtype=float32", "num_prompts=3"} <= set(exact)
    assert not any(o.startswith("per_category") for o in exact)


def test_rows_name_their_engine_drafter_and_baseline_and_each_plain_row_comes_once(table):
    rows = table.rows_of("vllm:humaneval", "vllm", "humaneval", summary(
        "vanilla", "vllm", "vllm_draft", baseline={"vllm_draft": "vllm"}))
    assert [(r["decoder"], r["engine"], r["baseline"], r["drafter"]) for r in rows] == [
        ("vllm", "vllm", "vanilla", None), ("vllm_draft", "vllm", "vllm", None)]  # vanilla comes from ours
    assert rows[1]["speedup_low"] == 1.2 and rows[1]["turns"] == 20 and rows[1]["cpu"]["cores"] >= 1
    assert [r["decoder"] for r in table.rows_of("vllmngram:x", "vllmngram", "humaneval",
                                                summary("vanilla", "vllm", "vllm_ngram"))] == ["vllm_ngram"]
    mine = table.rows_of("eagle3-1/llamacpp:humaneval", "eagle3-1/llamacpp", "humaneval",
                         summary("vanilla", "llamacpp", "llamacpp_eagle3"))
    assert [(r["decoder"], r["drafter"]) for r in mine] == [("llamacpp_eagle3", "eagle3-1")]


def test_the_table_is_rendered_per_prompt_set_with_fp32_exactness(table):
    table.DOC.write_text(f"# T\n\n{table.BEGIN}\nold\n{table.END}\n\nafter\n", encoding="utf-8")
    rows = (table.rows_of("ours:humaneval", "ours", "humaneval", summary("vanilla", "draft"))
            + table.rows_of("medusa-1:humaneval", "medusa-1", "humaneval", summary("vanilla", "tree"))
            + table.rows_of("fp32:humaneval", "fp32", "humaneval", summary("vanilla", "draft"))
            + table.rows_of("eagle3-1/llamacpp:humaneval", "eagle3-1/llamacpp", "humaneval",
                            summary("vanilla", "llamacpp", "llamacpp_eagle3")))
    rows[-1]["settings"] = {"draft_max": 3, "outtype": "q8_0"}
    rows[-2]["exact"] = 0.5
    table.render(rows)
    text = table.DOC.read_text(encoding="utf-8")
    assert text.startswith("# T\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    lines = [line for line in text.splitlines() if line.startswith("| ours")]
    assert [line.split(" | ")[1:3] for line in lines] == [["vanilla", "none"], ["draft", "Qwen2.5-Coder-0.5B"],
                                                          ["tree", "medusa-1"]]
    assert "| 0.50 |" in lines[1] and "(0.5/2.1)" in lines[1]  # the draft's fp32 exactness; the load around it
    assert "**humaneval** (20 prompts, up to 256 new tokens)" in text and "mt_bench" not in text
    assert "| llamacpp | llamacpp_eagle3 | eagle3-1 (draft_max 3, outtype q8_0) |" in text


def test_a_finished_cell_is_not_run_again(table, monkeypatch, capsys):
    table.TABLE.write_text(json.dumps(table.rows_of("ours:humaneval", "ours", "humaneval", summary("vanilla"))))
    monkeypatch.setattr(table, "measure", lambda *a: pytest.fail("a finished cell was measured again"))
    assert table.main(["--cells", "ours:humaneval"]) == 0
    assert "ours:humaneval: in" in capsys.readouterr().out


def test_a_drafters_recipe_runs_with_the_targets_settings_and_its_replies_are_kept(table, tmp_path, monkeypatch):
    calls = []

    def fake_run(command, log, env=None):
        calls.append((command, env))
        folder = Path(env["SCALE_OUT"]) / "replies-1"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "conversations.block000000.jsonl").write_text('{"id": "a"}\n')

    monkeypatch.setattr(table, "run", fake_run)
    args = type("Args", (), {"out": str(tmp_path / "runs"), "commit": False})()
    export = table.train("eagle3", 1, args)
    assert export == tmp_path / "runs" / "drafters" / "eagle3-1" / "export"
    command, env = calls[0]
    assert command == ["bash", "launch/recipe_scale.sh", "eagle3", "1"]
    assert env == {"SCALE_OUT": str(tmp_path / "runs" / "drafters"), "SCALE_MODEL": "qwen2_5_coder_1_5b",
                   "SCALE_MODEL_DTYPE": "bfloat16", "SCALE_CODE_SHARE": "0.5", "SCALE_EXCLUDE": "humaneval"}
    archive = table.REPLIES / "replies-1.tar.gz"
    assert archive.is_file()  # the first drafter of the size wrote the archive
    args.out = str(tmp_path / "elsewhere")  # another machine: the replies come back before the recipe runs
    monkeypatch.setattr(table, "run", lambda command, log, env=None: calls.append(
        sorted(p.name for p in (Path(env["SCALE_OUT"]) / "replies-1").iterdir())))
    table.train("medusa", 1, args)
    assert calls[-1] == ["conversations.block000000.jsonl"]


def test_each_row_is_priced_against_its_engines_plain_row_from_the_runs_results(table, tmp_path):
    run = tmp_path / "llamacpp-humaneval"
    run.mkdir()
    lines = []
    for prompt in ("a", "b"):  # per prompt: wall, prefill, new tokens
        key = {"prompt_id": prompt, "turn": 1}
        lines += [{**key, "decoder": "llamacpp", "wall_time_s": 11.0, "prefill_time_s": 1.0, "new_tokens": 100},
                  {**key, "decoder": "llamacpp_draft", "wall_time_s": 22.0, "prefill_time_s": 2.0, "new_tokens": 100}]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = [{"cell": "llamacpp:humaneval", "engine": "llamacpp", "decoder": "llamacpp", "tau": 1.0},
            {"cell": "llamacpp:humaneval", "engine": "llamacpp", "decoder": "llamacpp_draft", "tau": 4.0}]
    table.step_costs(run, rows)
    plain, draft = rows
    assert plain["step_s"] == pytest.approx(0.1) and plain["step_cost"] == pytest.approx(1.0)
    # 40 s of decoding over 200 / 4 = 50 steps: 0.8 s a step, 8 plain tokens; tau 4 over 8 predicts 0.5x
    assert draft["step_s"] == pytest.approx(0.8) and draft["step_cost"] == pytest.approx(8.0)
    assert draft["predicted_speedup"] == pytest.approx(0.5) and draft["prefill_s"] == pytest.approx(4.0)
    fp32 = [{"cell": "fp32:humaneval", "engine": "ours", "decoder": "draft", "tau": 4.0}]
    table.step_costs(run, fp32)  # exactness cells are not timed
    assert "step_cost" not in fp32[0]


def test_a_llamacpp_cell_sweeps_on_other_prompts_and_runs_with_the_fastest_setting(table, tmp_path, monkeypatch):
    points = table.sweep_points()
    assert {"draft_max": 2, "outtype": "f32"} in points and {"draft_max": 5, "outtype": "q8_0"} in points
    over = table.sweep_overrides("humaneval", 20, tmp_path / "export", {"draft_max": 3, "outtype": "q8_0"})
    assert {"prompts=humaneval", "prompt_offset=20", "decoders=[vanilla,llamacpp,llamacpp_eagle3]",
            "decoder.llamacpp_eagle3.draft_max=3", "decoder.llamacpp_eagle3.outtype=q8_0"} <= set(over)
    chat = table.sweep_overrides("mt_bench", 20, tmp_path / "export", points[0])
    assert "prompts=sharegpt" in chat and not any(o.startswith(("prompt_offset", "per_category")) for o in chat)

    # each run's ratio is llamacpp_eagle3 over its own run's plain llama.cpp: 12 / 8 beats 13 / 10
    speeds = {(2, "f32"): (10.0, 13.0), (3, "q8_0"): (8.0, 12.0)}
    calls = []

    def fake_run(command, log, env=None):
        out = Path(next(c for c in command if c.startswith("output_dir=")).split("=", 1)[1])
        settings = {c.split(".")[-1].split("=")[0]: c.split("=")[1] for c in command if "llamacpp_eagle3." in c}
        calls.append(out.name)
        plain, eagle = speeds.get((int(settings["draft_max"]), settings["outtype"]), (10.0, 9.0))
        metrics = {"vanilla": 5.0, "llamacpp": plain, "llamacpp_eagle3": eagle}
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(
            {"decoders": {k: {"tokens_per_second": v} for k, v in metrics.items()}}))

    monkeypatch.setattr(table, "run", fake_run)
    args = type("Args", (), {"out": str(tmp_path / "runs"), "humaneval": 20})()
    chosen = table.sweep("eagle3-1/llamacpp", "humaneval", tmp_path / "export", args)
    assert chosen == {"draft_max": 3, "outtype": "q8_0"}
    assert len(calls) == len(points) and "draft_max-3_outtype-q8_0" in calls  # names Hydra takes in output_dir
    calls.clear()
    assert table.sweep("eagle3-1/llamacpp", "humaneval", tmp_path / "export", args)["draft_max"] == 3
    assert calls == []  # finished runs are read back, not run again
    cell = table.eval_overrides("eagle3-1/llamacpp", "humaneval", 20, tmp_path / "export", {"draft_max": 3})
    assert "decoders=[vanilla,llamacpp,llamacpp_eagle3]" in cell and cell[-1] == "decoder.llamacpp_eagle3.draft_max=3"
    with pytest.raises(ValueError, match="no run with both llamacpp and llamacpp_eagle3"):
        table.best_point([({"draft_max": 2}, {"decoders": {"vanilla": {"tokens_per_second": 5.0}}}),
                          ({"draft_max": 3}, {"decoders": {"llamacpp": {"tokens_per_second": 0.0},
                                                           "llamacpp_eagle3": {"tokens_per_second": None}}})])
    tie = {"decoders": {"llamacpp": {"tokens_per_second": 10.0}, "llamacpp_eagle3": {"tokens_per_second": 12.0}}}
    assert table.best_point([({"draft_max": 2}, tie), ({"draft_max": 3}, tie)]) == {"draft_max": 2}


def test_the_headline_names_each_engines_fastest_row_of_each_kind(table):
    def row(cell, decoder, engine, drafter, speedup, prompts="humaneval", tps=5.0):
        return {"cell": cell, "prompts": prompts, "decoder": decoder, "engine": engine, "drafter": drafter,
                "tokens_per_second": tps, "speedup": speedup, "speedup_low": speedup - 0.1,
                "speedup_high": speedup + 0.1, "turns": 20, "tau": 2.0, "exact": 1.0, "baseline": "vanilla",
                "cpu": {"flags": ["avx512_bf16"]}}
    rows = [row("ours:humaneval", "vanilla", "ours", None, 1.0, tps=4.8),
            row("ours:humaneval", "draft", "ours", None, 1.41),
            row("ours:humaneval", "hf_assisted", "ours", None, 1.38),
            row("ours:humaneval", "hf_prompt_lookup", "ours", None, 1.54),
            row("medusa-1:humaneval", "tree", "ours", "medusa-1", 1.6),
            row("medusa-1:humaneval", "composite", "ours", "medusa-1", 2.1),
            row("fp32:humaneval", "composite", "ours", "medusa-1", 9.0),  # exactness cells are not speed
            row("llamacpp:humaneval", "llamacpp", "llamacpp", None, 2.3, tps=11.8),
            row("llamacpp:humaneval", "llamacpp_draft", "llamacpp", None, 0.74)]
    lines = table.headline(rows).splitlines()
    assert lines[2] == ("| humaneval (20) | ours | 4.80 | `composite` (medusa-1) 2.10x [2.00, 2.20] | "
                        "`draft` 1.41x [1.31, 1.51] | `hf_prompt_lookup` 1.54x [1.44, 1.64] |")
    assert lines[3] == "| humaneval (20) | llamacpp | 11.80 | - | `llamacpp_draft` 0.74x [0.64, 0.84] | - |"
    assert len(lines) == 4  # no vLLM row without its plain row
    table.render(rows)
    for doc in table.HEADLINE_DOCS:
        text = doc.read_text(encoding="utf-8")
        assert text.startswith("# top\n\n") and text.endswith("\n\nrest\n") and "old" not in text
        assert lines[2] in text
    before = {p: p.read_text(encoding="utf-8") for p in (table.DOC, *table.HEADLINE_DOCS)}
    for broken in ("no markers", f"{table.HEADLINE_END}\n{table.HEADLINE_BEGIN}\n",
                   f"{table.HEADLINE_BEGIN}\n{table.HEADLINE_END}\n" * 2):
        table.HEADLINE_DOCS[1].write_text(broken, encoding="utf-8")
        with pytest.raises(ValueError, match="must each be there once, in that order"):
            table.render(rows[:1])
        # nothing written: the table and the first headline are as they were
        assert all(p.read_text(encoding="utf-8") == before[p] for p in (table.DOC, table.HEADLINE_DOCS[0]))
