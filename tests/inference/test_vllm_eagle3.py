"""The real vLLM serves our EAGLE-3 export (``speculators/``, ``method: eagle3``): greedy replies equal plain vLLM's
in fp32, its spec-decode counters come back through our worker, and a drafter trained by our pipeline
(``medusa-train heads=eagle3``, self-distilled replies, ``export_vllm=true``) is accepted by vLLM per position as our
tree decoder's chain accepts it (the export is faithful: taps, tensor names, norms, d2t). The ``vllm_eagle3`` decoder
refuses what vLLM cannot serve as eagle3 before it starts.

SmolLM2-135M-Instruct in fp32 (taps (2, 15, 27), a 4,096-token draft vocabulary), engines with ``enforce_eager``.
Tests marked ``vllm`` skip, naming the install command, where vLLM's environment is missing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from inference.decoders import DecodeConfig, TreeDecoder
from medusa_train.models.catalog import new_spec
from medusa_train.drafters.eagle3.drafter import Eagle3Drafter
from medusa_train.drafters.eagle3.vllm import speculative_config as eagle3_speculative_config
from medusa_train.engines.vllm_env import VllmWorker
from medusa_train.export import load_heads, save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.loading.base import engine_model_path
from medusa_train.models.speculative import SpeculativeModel
from medusa_train.chat.prompts import encode_prompt, load_prompts
from medusa_train.training.recipe import build_recipe
from medusa_train.tree.buffers import chain_choices
from tests.conftest import VOCAB, make_tiny_model
from tests.inference.test_vllm import base, continuations, smollm2  # noqa: F401 - fixtures
from tests.medusa_train.test_training import compose_train

K = 3
DRAFT_VOCAB = 4096
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def eagle3_drafter(model, seed: int = 0) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for ``model`` (vLLM's default taps) over a random 4,096-token draft vocabulary; its
    lm_head starts as the target's rows."""
    config = model.config
    spec = new_spec("eagle3", {}, config, num_heads=K, num_layers=1, hidden_size=config.hidden_size,
                    vocab_size=config.vocab_size, head_vocab_size=DRAFT_VOCAB)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(config.vocab_size, generator=gen)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(spec, torch.sort(pool[:DRAFT_VOCAB]).values)
    drafter.init_from_lm_head(model.get_output_embeddings().weight)
    return drafter


# ---------------------------------------------------------------- no vLLM needed


def test_vllm_eagle3_refuses_medusa_heads_and_an_export_without_speculators(tmp_path):
    target = make_tiny_model(num_hidden_layers=8)
    medusa = save_export(MedusaHeads(HeadsSpec(2, 1, 32, VOCAB)), tmp_path / "medusa", "org/tiny", base_model=target)
    with pytest.raises(ValueError, match=r"head_type 'medusa' \(Medusa heads\) is not a drafter vLLM serves as "
                                         r"method eagle3.*vllm_medusa"):
        eagle3_speculative_config(medusa)
    spec = new_spec("eagle3", {}, target.config, num_heads=4, num_layers=1, hidden_size=32, vocab_size=VOCAB)
    drafter = Eagle3Drafter(spec)
    no_vllm = save_export(drafter, tmp_path / "no_vllm", "org/tiny", vllm=False, base_model=target)
    with pytest.raises(FileNotFoundError, match=r"speculators/config\.json not found: re-export the drafter with "
                                                r"export_vllm=true"):
        eagle3_speculative_config(no_vllm)
    export = save_export(drafter, tmp_path / "eagle3", "org/tiny", base_model=target)
    assert eagle3_speculative_config(export) == {"method": "eagle3", "model": str((export / "speculators").resolve()),
                                                 "num_speculative_tokens": 4}
    assert eagle3_speculative_config(export, 2)["num_speculative_tokens"] == 2
    with pytest.raises(ValueError, match="num_speculative_tokens must be at least 1"):
        eagle3_speculative_config(export, 0)


def serve_script():
    """``benchmarks/serve_vllm.py`` as a module."""
    spec = importlib.util.spec_from_file_location("serve_vllm", Path(__file__).parents[2] / "benchmarks" /
                                                  "serve_vllm.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_serve_script_sweeps_the_drafters_k_and_names_the_fastest(tmp_path, capsys):
    script = serve_script()
    target = make_tiny_model(num_hidden_layers=8)
    spec = new_spec("eagle3", {}, target.config, num_heads=4, num_layers=1, hidden_size=32, vocab_size=VOCAB)
    eagle3 = save_export(Eagle3Drafter(spec), tmp_path / "eagle3", "org/tiny", base_model=target)
    medusa = save_export(MedusaHeads(HeadsSpec(2, 1, 32, VOCAB)), tmp_path / "medusa", "org/tiny", base_model=target)
    folder = str((eagle3 / "speculators").resolve())
    assert [script.drafter_config(eagle3, k) for k in (None, 1, 6)] == [
        ("vllm_eagle3", {"method": "eagle3", "model": folder, "num_speculative_tokens": k}) for k in (4, 1, 6)]
    assert script.drafter_config(medusa, None) == ("vllm_medusa", {"method": "medusa", "num_speculative_tokens": 2,
                                                                   "model": str((medusa / "vllm").resolve())})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 2\]"):
        script.drafter_config(medusa, 3)
    assert script.parse_args(["--export", "x", "--k", "1", "2", "4"]).k == [1, 2, 4]
    for argv, message in ((["--k", "2", "2"], "--k must be distinct values >= 1"),
                          (["--k", "0"], "--k must be distinct values >= 1"),
                          (["--serve", "--k", "1", "2"], "--serve starts one server: give one --k")):
        with pytest.raises(SystemExit):
            script.parse_args(["--export", "x", *argv])
        assert message in capsys.readouterr().err
    def run(per_call: list[float], plain: list[float] | None = None) -> dict:
        """An engine's record over 6 generate calls of 10 tokens, taking ``per_call`` seconds each."""
        from inference.evaluation.intervals import ratio_interval

        plain = plain or [0.5] * 6
        tokens = [10] * 6
        return {"tokens_per_second": 60 / sum(per_call), "speedup": sum(plain) / sum(per_call),
                "call_tokens": tokens, "call_seconds": per_call, "mean_accepted_tokens": 1.5,
                "acceptance_per_position": [0.5],
                "over_plain": ratio_interval(tokens, per_call, tokens, plain).record()}

    runs = {"vllm": run([0.5] * 6), "vllm_eagle3_k1": run([0.45, 0.46, 0.44, 0.45, 0.46, 0.44]),
            "vllm_eagle3_k2": run([0.40, 0.42, 0.41, 0.40, 0.42, 0.41]),
            "vllm_eagle3_k4": run([0.55, 0.56, 0.54, 0.55, 0.56, 0.54])}
    ks = {"vllm_eagle3_k1": 1, "vllm_eagle3_k2": 2, "vllm_eagle3_k4": 4}
    best = script.fastest(runs, ks)
    assert (best["k"], best["engine"], best["beats_plain"]) == (2, "vllm_eagle3_k2", True)
    assert best["over_plain"] == runs["vllm_eagle3_k2"]["over_plain"] and best["over_plain"]["low"] > 1
    noisy = {**runs, "vllm_eagle3_k2": run([0.1, 0.7, 0.1, 0.7, 0.1, 0.7])}  # fastest, but not beyond the noise
    assert script.fastest(noisy, ks)["k"] == 2 and script.fastest(noisy, ks)["beats_plain"] is False
    # the length to serve: the fastest only when it beats the export's default beyond the noise
    assert script.choose_k(runs, ks, 4)["num_speculative_tokens"] == 2
    assert script.choose_k(noisy, ks, 4)["num_speculative_tokens"] == 4
    summary = {"batches": {"1": runs, "8": runs}, "ks": ks, "default_k": 4, "engine": "vllm 0.32.0",
               "speculative_configs": {"vllm_eagle3_k1": {"method": "eagle3"}}, "dtype": "bfloat16",
               "compute_threads": 2, "prompts": 6, "max_new_tokens": 10}
    recorded = script.record(eagle3, summary)
    assert recorded["num_speculative_tokens"] == 2 and recorded["chosen"]["batch"] == 1
    assert json.loads((eagle3 / "vllm_speculative.json").read_text()) == json.loads(json.dumps(recorded))
    # vLLM's EAGLE-3 row now defaults to it; a setting or recorded=False does not; the Medusa export ignores it
    assert eagle3_speculative_config(eagle3)["num_speculative_tokens"] == 2
    assert eagle3_speculative_config(eagle3, 3)["num_speculative_tokens"] == 3
    assert script.drafter_config(eagle3, None, tuned=False)[1]["num_speculative_tokens"] == 4
    (medusa / "vllm_speculative.json").write_text(json.dumps({**recorded}))
    assert script.drafter_config(medusa, None)[1]["num_speculative_tokens"] == 2  # method eagle3: not Medusa's
    (eagle3 / "vllm_speculative.json").write_text(json.dumps({"method": "eagle3", "num_speculative_tokens": 0}))
    with pytest.raises(ValueError, match=r"vllm_speculative\.json: num_speculative_tokens must be a positive int"):
        eagle3_speculative_config(eagle3)
    with pytest.raises(SystemExit):
        script.parse_args(["--export", "x", "--serve", "--record"])
    assert "--record measures; --serve serves" in capsys.readouterr().err


# ---------------------------------------------------------------- the real vLLM

vllm = pytest.mark.vllm


def serve(model_path: str, prompts: list[list[int]], new_tokens: int, spec: dict | None) -> dict:
    with VllmWorker(model_path, dtype="float32", speculative_config=spec, max_model_len=1024,
                    enforce_eager=True, max_num_seqs=1) as worker:
        replies = [worker.generate([p], new_tokens, stop_token_ids=[]) for p in prompts]
    spec_counts = {k: sum(r["spec"][k] for r in replies) for k in ("num_drafts", "num_draft_tokens",
                                                                   "num_accepted_tokens")}
    per_pos = [sum(r["spec"]["accepted_per_pos"][j] for r in replies) for j in range(K)] if spec else []
    return {"tokens": [r["outputs"][0]["token_ids"] for r in replies], **spec_counts, "accepted_per_pos": per_pos}


@vllm
@pytest.mark.slow
def test_vllm_serves_a_random_eagle3_export_with_plain_replies(smollm2, base, continuations, tmp_path):
    model, _ = base
    export = save_export(eagle3_drafter(model), tmp_path / "export", TARGET, base_model=model)
    prompts = [s[:-8] for s in continuations]  # the last 8 greedy tokens are the reply asked for
    path = engine_model_path(smollm2)
    plain = serve(path, prompts, 8, None)
    eagle3 = serve(path, prompts, 8, eagle3_speculative_config(export))
    assert eagle3["tokens"] == plain["tokens"] == [s[-8:] for s in continuations]  # fp32 greedy: identical
    assert eagle3["num_drafts"] > 0 and eagle3["num_draft_tokens"] == K * eagle3["num_drafts"]
    assert len(eagle3["accepted_per_pos"]) == K and eagle3["accepted_per_pos"] == sorted(eagle3["accepted_per_pos"],
                                                                                        reverse=True)
    assert plain["num_drafts"] == 0


REPLY = 32  # tokens vLLM generates per prompt; it verifies drafts past the end, so the drafter learns REPLY + K
PROMPTS = load_prompts("mt_bench", offset=76, num_prompts=4)  # four short first turns (42-44 tokens with the template)


def train_eagle3(smollm2, output_dir) -> None:
    """``medusa-train heads=eagle3`` on the four PROMPTS' self-distilled replies (HF greedy, fp32, REPLY + K tokens
    each), over-fitted (50 steps of the whole batch), exported with ``speculators/``."""
    overrides = {
        "model": "smollm2_135m", "model.name_or_path": smollm2.name_or_path, "model.dtype": "float32",
        "heads": "eagle3", "heads.num_heads": K,
        "data.source": "prompts", "data.prompts": json.dumps([p.turns[0] for p in PROMPTS]),
        "data.self_distill": True, "data.self_distill_engine": "hf", "data.max_new_tokens": REPLY + K,
        "data.generation_batch_size": len(PROMPTS), "data.eval_fraction": 0.0,
        "trainer.per_device_train_batch_size": len(PROMPTS), "trainer.max_steps": 50, "trainer.learning_rate": 1e-2,
        "trainer.warmup_ratio": 0.0, "trainer.save_steps": 50, "trainer.logging_steps": 10,
        "trainer.disable_tqdm": True, "hidden_cache": True, "max_length": 256, "export_vllm": True,
        "output_dir": str(output_dir),
    }
    build_recipe(compose_train([f"{k}={v}" for k, v in overrides.items()])).run()


def chain_acceptance(accepted_lengths: list[int], reply: int) -> tuple[int, list[int]]:
    """``(passes, accepted per draft position [K])`` of a chain decoder's passes, counted as vLLM counts them: the
    passes that start while fewer than ``reply`` tokens are out (the prefill's token first); a pass that kept
    ``n`` tokens accepted the drafts at positions 0..n-2."""
    out, passes, per_pos = 1, 0, [0] * K
    for n in accepted_lengths:
        if out >= reply:
            break
        passes, out = passes + 1, out + n
        for j in range(n - 1):
            per_pos[j] += 1
    return passes, per_pos


@vllm
@pytest.mark.slow
def test_vllm_accepts_our_trained_eagle3_export_as_our_chain_does(smollm2, base, tmp_path):
    """The export is faithful: a drafter trained by our pipeline on these prompts' self-distilled replies is
    accepted by vLLM at every draft position within 0.05 of what our tree decoder's chain (depth K, greedy, fp32)
    accepts of the same export (a shifted tap, a skipped tensor or another norm would drop vLLM's to near zero);
    vLLM accepts more than 1.1 tokens per step, and its replies with the drafter equal plain vLLM's and ours."""
    model, tokenizer = base
    train_eagle3(smollm2, tmp_path / "run")
    export = tmp_path / "run" / "export"
    heads, _ = load_heads(export, base_model=model, dtype=torch.float32)
    decoder = TreeDecoder(SpeculativeModel(model, heads), chain_choices(K))
    prompts = [encode_prompt(tokenizer, p.first_turn_messages()) for p in PROMPTS]
    passes, ours = 0, [0] * K
    replies = []
    for ids in prompts:
        result = decoder.generate(ids, DecodeConfig(max_new_tokens=REPLY + K, eos_token_ids=()))
        p, pos = chain_acceptance(result.accepted_lengths, REPLY)
        passes, ours = passes + p, [a + b for a, b in zip(ours, pos)]
        replies.append(result.tokens[:REPLY])
    path = engine_model_path(smollm2)
    served = serve(path, prompts, REPLY, eagle3_speculative_config(export))
    plain = serve(path, prompts, REPLY, None)
    assert served["tokens"] == plain["tokens"] == replies  # fp32 greedy: identical with and without the drafter
    ours_rate = [a / passes for a in ours]
    vllm_rate = [a / served["num_drafts"] for a in served["accepted_per_pos"]]
    print(f"passes ours {passes} vLLM {served['num_drafts']}; acceptance per position ours {ours_rate}, "
          f"vLLM {vllm_rate}")
    assert ours_rate[0] > 0.5  # the drafter knows these replies
    assert all(abs(a - b) <= 0.05 for a, b in zip(ours_rate, vllm_rate)), (ours_rate, vllm_rate)
    assert 1 + served["num_accepted_tokens"] / served["num_drafts"] > 1.1
