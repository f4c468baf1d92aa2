"""Every decoder on pre-packed kernels: greedy output equal to plain greedy decoding under the same kernels, fp32 and
bf16, and medusa-eval converting the model once for all of them."""

from __future__ import annotations

import json

import pytest
import torch

from inference.decoders.base import DecodeConfig
from inference.decoders.draft import DraftDecoder
from inference.decoders.hf_peers import HfAssistedDecoder, HfPromptLookupDecoder
from inference.decoders.lookahead import LookaheadDecoder
from inference.decoders.tree import TreeDecoder
from inference.decoders.vanilla import VanillaDecoder
from inference.draft_loading import self_layer_draft
from medusa_train.loading.cpu_kernels import PackedLinear, onednn_available, pack_linear_layers
from medusa_train.models.speculative import SpeculativeModel, new_heads_for
from tests.conftest import BF16, make_tiny_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")]
PROMPTS = ([1, 5, 9, 33, 20], [1, 70], [1, 44, 12, 90, 3, 3, 61, 8, 17])


def packed_medusa(family: str, dtype: torch.dtype) -> SpeculativeModel:
    base = make_tiny_model(family, initializer_range=0.3).to(dtype).requires_grad_(False)
    heads = new_heads_for(base, num_heads=2, dtype=dtype)
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    pack_linear_layers(base)
    return SpeculativeModel(base, heads.requires_grad_(False))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_decoder_equals_plain_greedy_on_the_same_packed_kernels(family, dtype):
    model = packed_medusa(family, dtype)
    base = model.base
    assert isinstance(base.get_output_embeddings(), PackedLinear)
    draft = self_layer_draft(base, 1)  # shares the target's packed layers
    decoders = [TreeDecoder(model, [[0], [0, 0], [1], [0, 1]], topk=2),
                DraftDecoder(base, draft, num_draft_tokens=3),
                LookaheadDecoder(base, 4, 3, 4),
                HfPromptLookupDecoder(base, 4),
                HfAssistedDecoder(base, draft, 3)]
    config = DecodeConfig(max_new_tokens=16)
    for prompt in PROMPTS:
        expected = VanillaDecoder(base).generate(prompt, config).tokens
        hf = base.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert hf == expected, (family, dtype, prompt)  # vanilla is HF's greedy decoding on these kernels
        for decoder in decoders:
            assert decoder.generate(prompt, config).tokens == expected, (family, dtype, type(decoder).__name__)


def test_medusa_eval_packs_the_model_once_for_every_decoder(tmp_path, monkeypatch):
    import medusa_train.loading.runtime as runtime
    from inference.evaluation.eval_run import evaluate
    from medusa_train.config.schema import ModelConfig
    from medusa_train.export import save_export
    from medusa_train.loading.export import export_extra_config
    from tests.conftest import make_tiny_tokenizer
    from tests.inference.test_evaluate import QUESTIONS, TREE, config

    calls = []
    original = runtime.apply_cpu_kernels
    monkeypatch.setattr(runtime, "apply_cpu_kernels", lambda m, c: calls.append(c.kernels) or original(m, c))
    base = make_tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    make_tiny_tokenizer().save_pretrained(tmp_path / "base")
    folder = tmp_path / "export"
    save_export(new_heads_for(base, num_heads=2), folder, str(tmp_path / "base"), vllm=False,
                extra_config=export_extra_config(ModelConfig(name_or_path=str(tmp_path / "base"))))
    (folder / "medusa_choices.json").write_text(json.dumps(TREE))
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS[:2]))
    summary = evaluate(config(folder, prompts, tmp_path / "run", "cpu_kernels=packed", "max_turns=1",
                              "decoders=[vanilla,medusa,draft,lookahead,hf_prompt_lookup]",
                              "decoder.draft.num_layers=1"))
    assert calls == ["onednn_packed"]  # one conversion, shared by the five decoders (the draft's layers too)
    assert summary["cpu_kernels"]["kernels"] == "onednn_packed" and summary["cpu_kernels"]["packed_layers"] == 15
    assert summary["cpu_kernels"]["one_row"] in ("pytorch_gemv", "onednn")  # measured on this CPU, recorded
    assert set(summary["cpu_kernels"]["one_row_ms"]) == {"pytorch_gemv", "onednn"}
    assert all(m["exact_match_vs_greedy"] == 1.0 for m in summary["decoders"].values())
    plain = evaluate(config(folder, prompts, tmp_path / "plain", "cpu_kernels=none", "max_turns=1"))
    assert plain["cpu_kernels"] == {"kernels": "pytorch", "requested": "none", "reason": "requested",
                                    "packed_layers": 0, "one_row": None, "one_row_ms": {}}
