"""The real vLLM serves our EAGLE-3 export (``speculators/``, ``method: eagle3``): greedy replies equal plain vLLM's
in fp32, its spec-decode counters come back through our worker, and an over-fitted drafter's per-position acceptance
in vLLM equals the chain acceptance our own drafter computes on the same replies (the export is faithful: taps,
tensor names, norms, d2t). The ``vllm_eagle3`` decoder refuses what vLLM cannot serve as eagle3 before it starts.

SmolLM2-135M-Instruct in fp32 (taps (2, 15, 27), a 4,096-token draft vocabulary), engines with ``enforce_eager``.
Tests marked ``vllm`` skip, naming the install command, where vLLM's environment is missing.
"""

from __future__ import annotations

import pytest
import torch

from inference.engines.vllm_env import VllmWorker, eagle3_speculative_config
from medusa_train.drafters.catalog import new_spec
from medusa_train.eagle3 import Eagle3Drafter
from medusa_train.export import save_export
from medusa_train.features import FINAL, layer_feature, target_features
from medusa_train.heads import HeadsSpec, MedusaHeads
from medusa_train.loading.base import engine_model_path
from tests.conftest import VOCAB, make_tiny_model
from tests.inference.test_vllm import base, continuations, smollm2  # noqa: F401 - fixtures

K = 3
DRAFT_VOCAB = 4096
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"


def eagle3_drafter(model, seed: int = 0, extra_tokens: torch.Tensor | None = None) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for ``model`` (vLLM's default taps) over a 4,096-token draft vocabulary holding
    ``extra_tokens``; its lm_head starts as the target's rows."""
    config = model.config
    spec = new_spec("eagle3", {}, config, num_heads=K, num_layers=1, hidden_size=config.hidden_size,
                    vocab_size=config.vocab_size, head_vocab_size=DRAFT_VOCAB)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(config.vocab_size, generator=gen)
    if extra_tokens is not None:
        pool = torch.cat([extra_tokens.unique(), pool[~torch.isin(pool, extra_tokens)]])
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


REPLY = 40  # tokens vLLM generates per prompt; our reference continues K further (vLLM verifies drafts past the end)


@pytest.fixture(scope="module")
def long_continuations(base) -> list[list[int]]:
    """Four MT-Bench first turns + SmolLM2's greedy fp32 reply of REPLY + K tokens (no EOS stop)."""
    from inference.decoders.base import DecodeConfig
    from inference.decoders.vanilla import VanillaDecoder
    from medusa_train.prompts import encode_prompt, load_prompts

    model, tokenizer = base
    decoder = VanillaDecoder(model, tokenizer=tokenizer)
    sequences = []
    for prompt in load_prompts("mt_bench", num_prompts=4):
        ids = encode_prompt(tokenizer, prompt.first_turn_messages())
        reply = decoder.generate(ids, DecodeConfig(max_new_tokens=REPLY + K, eos_token_ids=()))
        sequences.append((len(ids), ids + reply.tokens))
    return sequences


def drafter_inputs(model, drafter: Eagle3Drafter, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fused target features [1, T, H], embeddings [1, T, H])`` of a sequence (the drafter's step-1 inputs:
    position t reads the feature at t and the embedding of token t + 1)."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        features, _ = target_features(model.model, tokens, layers=drafter.spec.feature_layers)
        embeds = model.get_input_embeddings()(tokens)
    taps = [features[layer_feature(i)] for i in drafter.spec.feature_layers]
    return torch.cat(taps, dim=-1), embeds


def overfit(drafter: Eagle3Drafter, data: list[tuple[torch.Tensor, torch.Tensor, list[int]]], steps: int) -> float:
    """Train the drafter's first step to predict token t + 2 at every position of ``data`` (taps, embeddings, ids);
    returns its final top-1 accuracy."""
    opt = torch.optim.Adam(drafter.parameters(), lr=2e-3)
    inverse = torch.full((drafter.spec.vocab_size,), -100, dtype=torch.long)
    inverse[drafter.token_map] = torch.arange(drafter.spec.out_size)
    for _ in range(steps):
        correct = total = 0
        opt.zero_grad()
        for taps, embeds, ids in data:
            T = len(ids) - 2
            hidden = drafter.fc(taps[:, :T])
            logits, _ = drafter(hidden, embeds[:, 1:T + 1], torch.arange(T)[None])
            labels = inverse[torch.tensor(ids[2:])]
            torch.nn.functional.cross_entropy(logits[0], labels).backward()
            correct += int((logits[0].argmax(-1) == labels).sum())
            total += T
        opt.step()
    return correct / total


@torch.no_grad()
def chain_acceptance(drafter: Eagle3Drafter, taps: torch.Tensor, embed, ids: list[int], prompt_len: int,
                     reply: int) -> tuple[int, list[int]]:
    """vLLM's chain drafting replayed with our drafter on a greedy sequence: after the prefill (token ``prompt_len``
    sampled), each pass drafts K tokens from the last committed position (own features after the first), accepts
    the longest prefix equal to the sequence and commits one more; passes run while fewer than ``reply`` tokens are
    out. Returns ``(passes, accepted per draft position [K])``."""
    fused = drafter.fc(taps)  # [1, T, H]
    passes, per_pos = 0, [0] * K
    committed = prompt_len + 1  # tokens 0..prompt_len; target features at 0..prompt_len - 1
    while committed - prompt_len < reply:
        n = committed - 1  # positions 0..n-1 read target features, the first draft comes out at n - 1
        hidden, tokens, drafts = fused[:, :n], list(ids[1:n + 1]), []
        for _ in range(K):
            logits, out = drafter(hidden, embed(torch.tensor([tokens])), torch.arange(len(tokens))[None])
            drafts.append(int(drafter.to_base_tokens(logits[0, -1].argmax())))
            hidden, tokens = torch.cat([hidden, out[:, -1:]], dim=1), tokens + drafts[-1:]
        accepted = 0
        while accepted < K and drafts[accepted] == ids[committed + accepted]:
            accepted += 1
        passes += 1
        for j in range(accepted):
            per_pos[j] += 1
        committed += accepted + 1
    return passes, per_pos


@vllm
@pytest.mark.slow
def test_vllm_accepts_an_overfit_eagle3_drafter_as_our_chain_does(smollm2, base, long_continuations, tmp_path):
    """The export is faithful: vLLM's per-position acceptance of a drafter that knows these replies equals the
    acceptance our drafter's own chain gets on them within 0.05 (a shifted tap, a skipped tensor or another norm
    would drop vLLM's to near zero), and it accepts more than 1.1 tokens per step."""
    model, _ = base
    embed = model.get_input_embeddings()
    all_ids = torch.tensor([t for _, ids in long_continuations for t in ids])
    drafter = eagle3_drafter(model, extra_tokens=all_ids)
    inputs = [(*drafter_inputs(model, drafter, ids), ids) for _, ids in long_continuations]
    accuracy = overfit(drafter, inputs, steps=120)
    assert accuracy > 0.9, accuracy
    drafter.eval()
    passes, ours = 0, [0] * K
    for (prompt_len, ids), (taps, _, _) in zip(long_continuations, inputs):
        p, pos = chain_acceptance(drafter, taps, embed, ids, prompt_len, REPLY)
        passes, ours = passes + p, [a + b for a, b in zip(ours, pos)]
    export = save_export(drafter, tmp_path / "export", TARGET, base_model=model)
    prompts = [ids[:n] for n, ids in long_continuations]
    served = serve(engine_model_path(smollm2), prompts, REPLY, eagle3_speculative_config(export))
    assert served["tokens"] == [ids[n:n + REPLY] for n, ids in long_continuations]  # fp32 greedy
    ours_rate = [a / passes for a in ours]
    vllm_rate = [a / served["num_drafts"] for a in served["accepted_per_pos"]]
    print(f"passes ours {passes} vLLM {served['num_drafts']}; acceptance per position ours {ours_rate}, "
          f"vLLM {vllm_rate}")
    assert ours_rate[0] > 0.5  # the drafter knows these replies
    assert all(abs(a - b) <= 0.05 for a, b in zip(ours_rate, vllm_rate)), (ours_rate, vllm_rate)
    assert 1 + served["num_accepted_tokens"] / served["num_drafts"] > 1.1
