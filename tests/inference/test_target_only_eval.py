"""``medusa-eval`` of a target alone (no export of ours): ``model=`` names the target, ``draft=`` the draft model of
every decoder that drafts with one, and each speculative row is measured against its own engine's plain row.

On tiny random Qwen2 models (a target and a one-layer draft sharing its tokenizer), fp32: every decoder of ours that
needs no drafter of ours (``draft`` and ``hf_assisted`` with the draft model, ``hf_prompt_lookup``, ``lookahead``)
returns plain greedy decoding's replies token for token. The refusals come before any model loads. The engine rows'
settings reach vLLM's ``speculative_config`` and llama-server's command line as those engines spell them (stand-ins
for the engines here; the real engines in ``test_coder_engines.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas
from inference.decoders import DecodeConfig
from inference.evaluation.eval_run import evaluate
from inference.evaluation.summary import decoder_metrics
from inference.registry import (
    BuildContext,
    LlamaCppDraftSettings,
    LlamaCppNgramSettings,
    VllmDraftSettings,
    VllmNgramSettings,
    baseline_of,
    build_decoder,
    check_request,
    decoder_settings,
    takes_draft,
    with_run_draft,
)
from medusa_train.config.schema import ModelConfig
from inference.conf import CONF_DIR
from tests.conftest import make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
register_schemas()  # what conf/evaluate.yaml composes from

QUESTIONS = [{"question_id": 1, "category": "code", "turns": ["def add(a, b): return a + b. Now def sub(a, b):"]},
             {"question_id": 2, "category": "chat", "turns": ["hello there, how are you today?"]}]
OURS = ["vanilla", "draft", "hf_assisted", "hf_prompt_lookup", "lookahead"]


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, draft folder): a two-layer and a one-layer random Qwen2 with one tokenizer."""
    root = tmp_path_factory.mktemp("qwen")
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        make_tiny_model("qwen2", seed=seed, num_hidden_layers=layers).save_pretrained(root / name)
        make_tiny_tokenizer().save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def eval_config(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=["max_new_tokens=12", "progress=false", "warmup=0", "plots=false",
                                              "threads=1", "dtype=float32", *overrides])


def draft_overrides(draft: Path) -> list[str]:
    """``draft=model`` (the draft/ preset of a separate model) pointed at ``draft``."""
    return ["draft=model", f"draft.model.name_or_path={draft}", "draft.model.format=hf", "draft.model.tokenizer_path=null"]


def test_the_target_alone_runs_every_decoder_that_needs_no_drafter_greedy_exact(qwen_pair, prompts, tmp_path):
    target, draft = qwen_pair
    out = tmp_path / "out"
    summary = evaluate(eval_config(f"+model.name_or_path={target}", "+model.format=hf", f"prompts={prompts}",
                                   f"output_dir={out}", f"decoders=[{','.join(OURS)}]", "decoder.draft.kind=self_layers",
                                   "decoder.draft.confidence_threshold=0.4", *draft_overrides(draft)))
    assert list(summary["decoders"]) == OURS
    for name, m in summary["decoders"].items():
        assert m["exact_match_vs_greedy"] == 1.0, name  # fp32: plain greedy decoding's replies, token for token
        assert m["baseline"] == "vanilla" and m["new_tokens"] > 0
    run = json.loads((out / "run.json").read_text())
    assert run["decoders"]["draft"] == {"draft": "model", "draft_model": str(draft)}  # draft= replaced kind
    assert run["decoders"]["hf_assisted"]["draft_model"] == str(draft)
    assert summary["model"] == str(target) and run["config"]["export_dir"] is None


@pytest.fixture
def model_cfg():
    """Compose with ``model=`` a model/ preset whose folder exists (no weights are read by the refusals)."""
    return [f"+model.name_or_path={Path(__file__).parent}", "+model.format=hf"]


def test_refusals_come_before_any_model_loads(qwen_pair, prompts, tmp_path, monkeypatch, model_cfg):
    from inference.evaluation import eval_run

    monkeypatch.setattr(eval_run, "load_target_for_inference", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(eval_run, "load_for_inference", lambda *a, **k: pytest.fail("loaded a model"))
    base = [f"prompts={prompts}", f"output_dir={tmp_path / 'out'}"]
    with pytest.raises(ValueError, match=r"export_dir: give export_dir=DIR .* or the target alone with model="):
        evaluate(eval_config(*base, "decoders=[vanilla]"))
    with pytest.raises(ValueError, match=r"decoders \['tree', 'composite'\] decode with a trained drafter, and no "
                                         r"export_dir is given: .*decoders=\[vanilla,draft\]"):
        evaluate(eval_config(*base, *model_cfg, "decoders=[vanilla,tree,composite,draft]"))
    with pytest.raises(ValueError, match=r"decoder.llamacpp_draft.model: llamacpp_draft drafts with a separate model "
                                         r"and none is given: pass draft=<draft preset>"):
        check_request("llamacpp_draft", LlamaCppDraftSettings(), DecodeConfig(max_new_tokens=4))
    _, draft = qwen_pair
    with pytest.raises(ValueError, match=r"draft: decoder.draft.model and draft= both name a draft model: keep one"):
        evaluate(eval_config(*base, *model_cfg, "decoders=[vanilla,draft]", "decoder.draft.kind=model",
                             "+decoder.draft.model.name_or_path=/elsewhere", *draft_overrides(draft)))
    with pytest.raises(ValueError, match=r"decoder.vllm_draft: draft= gives a self_layers draft, and vllm_draft loads "
                                         r"a separate draft model"):
        with_run_draft("vllm_draft", None, {"kind": "self_layers", "num_layers": 1})


def test_the_run_draft_fills_the_draft_model_of_every_decoder_that_takes_one():
    draft = {"kind": "model", "model": {"name_or_path": "/d", "format": "hf"}}
    assert [n for n in ("draft", "hf_assisted", "vllm_draft", "llamacpp_draft", "vllm_ngram", "lookahead", "vllm")
            if takes_draft(n)] == ["draft", "hf_assisted", "vllm_draft", "llamacpp_draft"]
    ours = decoder_settings("draft", with_run_draft("draft", {"num_draft_tokens": 3}, draft))
    assert (ours.kind, ours.model["name_or_path"], ours.num_draft_tokens) == ("model", "/d", 3)  # length kept
    engine = decoder_settings("llamacpp_draft", with_run_draft("llamacpp_draft", {"draft_max": 6}, draft))
    assert (engine.model["name_or_path"], engine.draft_max) == ("/d", 6)
    with pytest.raises(ValueError, match=r"prompt_lookup_min=5 must be <= prompt_lookup_max=4"):
        decoder_settings("vllm_ngram", {"prompt_lookup_min": 5})


def test_each_speculative_row_is_measured_against_its_own_engines_plain_row():
    """vLLM's rows over plain vLLM, llama.cpp's over plain llama.cpp, the engines' plain rows and ours over vanilla;
    without its engine's plain row a speculative row falls back to vanilla."""
    def row(tokens: int, wall: float, reply: list[int]) -> dict:
        return {"new_tokens": tokens, "wall_time_s": wall, "tokens": reply, "accepted_lengths": [1] * (tokens - 1),
                "forward_passes": tokens - 1, "prefill_time_s": 0.0, "stop_reason": "eos", "prompt_tokens": 3}

    units = [{"vanilla": row(10, 1.0, [1]), "draft": row(10, 0.5, [1]), "vllm": row(10, 2.0, [2]),
              "vllm_draft": row(10, 1.0, [2]), "llamacpp": row(10, 0.25, [3]), "llamacpp_ngram": row(10, 0.2, [4])}
             for _ in range(3)]
    table = decoder_metrics(units, greedy=True)
    assert {n: (m["baseline"], round(m["speedup"], 3)) for n, m in table.items()} == {
        "vanilla": ("vanilla", 1.0), "draft": ("vanilla", 2.0), "vllm": ("vanilla", 0.5),
        "vllm_draft": ("vllm", 2.0), "llamacpp": ("vanilla", 4.0), "llamacpp_ngram": ("llamacpp", 1.25)}
    assert table["vllm_draft"]["exact_match_vs_greedy"] == 1.0  # against plain vLLM's replies
    assert table["llamacpp_ngram"]["exact_match_vs_greedy"] == 0.0
    assert baseline_of("vllm_draft", ["vanilla", "vllm_draft"]) == "vanilla"


def test_engine_rows_reach_each_engine_as_it_spells_them(monkeypatch, tmp_path):
    """vLLM: ``speculative_config`` of method ``draft_model`` (the draft's HF folder) and ``ngram``; llama.cpp:
    ``--spec-type draft-simple -md DRAFT --spec-draft-n-max --spec-draft-p-min`` and ``--spec-type ngram-simple`` with
    its n and m, over stand-ins of both engines."""
    import inference.engines.llamacpp_server as server_module
    import medusa_train.engines.vllm_env as vllm_env
    from tests.inference.test_llamacpp import FAKE_SERVER

    started = []

    class Worker:
        vllm_version = "0.32.0"

        def __init__(self, model, **kwargs):
            started.append((model, kwargs["speculative_config"]))
            self.info, self.log_path, self.speculative_config = {"start_s": 0.0}, "log", kwargs["speculative_config"]

    monkeypatch.setattr(vllm_env, "VllmWorker", Worker)
    target = ModelConfig(name_or_path=str(tmp_path), format="hf")
    draft = {"name_or_path": str(tmp_path / "draft"), "format": "hf"}
    ctx = BuildContext(model=type("M", (), {"base": make_tiny_model("qwen2")})(), tokenizer=None, export_dir=None,
                       model_config=target)
    build_decoder("vllm_draft", VllmDraftSettings(model=draft, num_speculative_tokens=2), ctx)
    build_decoder("vllm_ngram", VllmNgramSettings(), ctx)
    assert started == [(str(tmp_path), {"method": "draft_model", "model": str(tmp_path / "draft"),
                                        "num_speculative_tokens": 2}),
                       (str(tmp_path), {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2})]

    bin_dir = tmp_path / "llamacpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "llamacpp" / ".medusa-llamacpp-installed").write_text("x")
    (bin_dir / "llama-server").write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    (bin_dir / "llama-server").chmod(0o755)
    monkeypatch.setenv("MEDUSA_LLAMACPP_DIR", str(tmp_path / "llamacpp"))
    for name in ("target.gguf", "draft.gguf"):
        (tmp_path / name).write_text("ok")
    ctx.model_config = ModelConfig(name_or_path=str(tmp_path), format="gguf", gguf_file="target.gguf")
    gguf_draft = {"name_or_path": str(tmp_path), "format": "gguf", "gguf_file": "draft.gguf"}
    built = build_decoder("llamacpp_draft", LlamaCppDraftSettings(model=gguf_draft), ctx)
    command = built.decoder.server.command
    assert command[command.index("--spec-type") + 1] == "draft-simple"
    assert [command[command.index(f) + 1] for f in ("-m", "-md", "--spec-draft-n-max", "--spec-draft-p-min")] == [
        str(tmp_path / "target.gguf"), str(tmp_path / "draft.gguf"), "3", "0.5"]
    assert built.decoder.generate([5], DecodeConfig(max_new_tokens=3)).tokens == [6, 7, 8]
    built.decoder.close()
    built = build_decoder("llamacpp_ngram", LlamaCppNgramSettings(ngram_size=2, draft_max=6), ctx)
    command = built.decoder.server.command
    assert "-md" not in command and command[command.index("--spec-type") + 1] == "ngram-simple"
    assert [command[command.index(f) + 1] for f in ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m")] == [
        "2", "6"]
    assert built.decoder.draft_max == 6  # reserved beyond the reply in the server's context
    built.decoder.close()
