"""The engines' own draft-model and n-gram speculation, run for real in ``medusa-eval`` without an export: vLLM's
``draft_model`` and ``ngram`` (``vllm_draft``, ``vllm_ngram``) and llama.cpp's ``draft-simple`` and ``ngram-simple``
(``llamacpp_draft``, ``llamacpp_ngram``) keep their own engine's plain greedy replies, token for token, and draft.

SmolLM2-135M-Instruct (fp32 in vLLM; its Q4_1 GGUF in llama.cpp) is its own draft model here: the check is that the
engine wires the draft in and stays exact, not that the draft is good. With Qwen2.5-Coder-1.5B and its 0.5B draft
installed (``bash launch/install_models.sh coder``), the real pair on two HumanEval problems in llama.cpp; it skips,
naming the command, where they are not. The tests that need an engine skip where it is not installed.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas
from inference.evaluation.eval_run import evaluate
from inference.evaluation.results import read_rows
from medusa_train.engines.llamacpp_env import llamacpp_available
from medusa_train.loading.chunked_gguf import NotInstalledError, installed_gguf
from inference.conf import CONF_DIR
from tests.inference.test_vllm import GGUF, smollm2  # noqa: F401 - fixture

register_schemas()

llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama.cpp is not installed: run `bash "
                              "launch/install_llamacpp.sh`")


def self_draft(smollm2) -> list[str]:  # noqa: F811 - the fixture's value
    """``draft=model`` pointed at SmolLM2's own GGUF."""
    return ["draft=model", f"draft.model.name_or_path={smollm2.name_or_path}", "draft.model.format=gguf",
            f"draft.model.gguf_file={GGUF}", "draft.model.tokenizer_path=null"]


def run_rows(tmp_path, *overrides: str) -> tuple[dict, dict]:
    """(rows by (prompt, decoder), summary) of one medusa-eval run."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"output_dir={tmp_path / 'eval'}", "max_turns=1", "plots=false",
                                             "progress=false", "warmup=0", *overrides])
    summary = evaluate(cfg)
    rows = {(r["prompt_id"], r["decoder"]): r for r in read_rows(tmp_path / "eval" / "results.jsonl")}
    return rows, summary


def check_exact_and_drafting(rows: dict, summary: dict, plain: str, speculative: list[str]) -> None:
    for name in speculative:
        m = summary["decoders"][name]
        assert m["baseline"] == plain and m["exact_match_vs_greedy"] == 1.0, name
        for (pid, decoder), row in rows.items():
            if decoder == name:
                assert row["tokens"] == rows[(pid, plain)]["tokens"] and row["new_tokens"] > 0
                assert sum(row["accepted_lengths"]) == row["new_tokens"] - 1
    assert summary["decoders"][plain]["baseline"] == "vanilla"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_draft_model_and_ngram_keep_plain_vllms_replies(smollm2, tmp_path):  # noqa: F811
    rows, summary = run_rows(tmp_path, "model=smollm2_135m", *self_draft(smollm2), "prompts=mt_bench",
                             "num_prompts=2", "max_new_tokens=24", "dtype=float32",
                             "decoders=[vanilla,vllm,vllm_draft,vllm_ngram]",
                             "decoder.vllm_draft.num_speculative_tokens=2")
    check_exact_and_drafting(rows, summary, "vllm", ["vllm_draft", "vllm_ngram"])
    assert summary["decoders"]["vllm_draft"]["mean_accepted_tokens"] > 2.5  # its own draft: nearly every token kept


@llamacpp
@pytest.mark.slow
def test_llamacpp_draft_model_and_ngram_keep_plain_llamacpps_replies(smollm2, tmp_path):  # noqa: F811
    rows, summary = run_rows(tmp_path, "model=smollm2_135m", *self_draft(smollm2), "prompts=mt_bench",
                             "num_prompts=2", "max_new_tokens=24", "dtype=float32",
                             "decoders=[vanilla,llamacpp,llamacpp_draft,llamacpp_ngram]",
                             "decoder.llamacpp_draft.draft_p_min=0")
    check_exact_and_drafting(rows, summary, "llamacpp", ["llamacpp_draft", "llamacpp_ngram"])
    assert summary["decoders"]["llamacpp_draft"]["mean_accepted_tokens"] > 2.5


@llamacpp
@pytest.mark.slow
def test_the_coder_pair_in_llamacpp(tmp_path):
    """The real 0.5B drafts for the real 1.5B in llama.cpp, exact against plain llama.cpp on two HumanEval problems;
    prompt lookup copies the problem's signature."""
    try:
        installed_gguf("qwen2_5_coder_1_5b"), installed_gguf("qwen2_5_coder_0_5b")
    except NotInstalledError as e:
        pytest.skip(str(e))
    rows, summary = run_rows(tmp_path, "model=qwen2_5_coder_1_5b", "draft=qwen2_5_coder_0_5b", "prompts=humaneval",
                             "num_prompts=2", "max_new_tokens=32",
                             "decoders=[vanilla,llamacpp,llamacpp_draft,llamacpp_ngram]")
    check_exact_and_drafting(rows, summary, "llamacpp", ["llamacpp_draft", "llamacpp_ngram"])
    assert summary["decoders"]["llamacpp_ngram"]["mean_accepted_tokens"] > 1.5  # the reply repeats the signature
