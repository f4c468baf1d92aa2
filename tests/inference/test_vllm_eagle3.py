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
