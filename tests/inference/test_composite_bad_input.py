"""Unusual and bad input to the composite tree decoder and to vLLM's recorded drafted length: valid edge requests
decode exactly as plain greedy decoding, a node budget far beyond what the tree can hold does not size the cache,
and bad values are refused by name (a ValueError, no traceback) before any engine starts."""

from __future__ import annotations

import json

import pytest

from inference.decoders import DecodeConfig, TreeDecoder
import inference.decoders.tree as medusa_module
from medusa_train.drafters.medusa.vllm import speculative_config
from medusa_train.engines.vllm_env import tuned_speculative_tokens
from medusa_train.export import save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.tree.composite import composite_tree
from tests.conftest import VOCAB, make_tiny_model
from tests.inference.test_decoders import PROMPTS, SMALL_TREE, greedy, random_heads
from tests.inference.test_vllm_eagle3 import serve_script

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the decoder ------------------------------------------------------------------------------------------------------

def test_a_mapping_with_keys_that_are_not_strings_is_refused_by_name():
    with pytest.raises(ValueError, match=r"composite takes the keys .* got \[1, 'nodes'\]"):
        composite_tree({1: 3, "nodes": 3})


@pytest.mark.parametrize("head_type,tree,dynamic,expected_nodes", [
    ("medusa", SMALL_TREE, None, 1 + 15 + 5),  # the heads' 15 nodes and one 5-token lookup draft
    ("eagle3", None, (3, 3, 8), 1 + 8 + 5),
])
def test_a_budget_beyond_the_heads_and_the_lookup_does_not_size_the_cache(monkeypatch, head_type, tree, dynamic,
                                                                          expected_nodes):
    base = make_tiny_model("llama")
    decoder = TreeDecoder(random_heads(head_type, base), tree, topk=10, dynamic_tree=dynamic,
                          composite={"nodes": 1 << 20, "lookup_length": 5})
    assert decoder.tree.num_nodes == expected_nodes
    capacities = []
    real = medusa_module.preallocated_cache
    monkeypatch.setattr(medusa_module, "preallocated_cache", lambda n: capacities.append(n) or real(n))
    prompt = PROMPTS[2] + PROMPTS[2]
    assert decoder.generate(prompt, DecodeConfig(max_new_tokens=20)).tokens == greedy(base, prompt, 20)
    assert capacities == [len(prompt) + 20 + expected_nodes]  # not a million slots per layer


def test_edge_requests_decode_as_plain_greedy():
    base = make_tiny_model("llama")
    model = random_heads("medusa", base)
    wide = TreeDecoder(model, SMALL_TREE, topk=10, composite={"nodes": 40, "lookup_length": 30})
    tiny = TreeDecoder(model, [[0]], topk=10, composite={"nodes": 1, "lookup_length": 1})
    prompts = [[1], [0], [0] * 9, [5, 6] * 6, PROMPTS[2]]  # one token, token 0, a lookup longer than the reply
    for decoder in (wide, tiny):
        for n in (1, 2, 7):
            assert [r.tokens for r in decoder.generate_batch(prompts, DecodeConfig(max_new_tokens=n))] == \
                [greedy(base, p, n) for p in prompts]
            for prompt in prompts:
                assert decoder.generate(prompt, DecodeConfig(max_new_tokens=n)).tokens == greedy(base, prompt, n)


# --- vLLM's recorded drafted length -----------------------------------------------------------------------------------

@pytest.mark.parametrize("record", [{"method": "Medusa", "num_speculative_tokens": 1},
                                    {"num_speculative_tokens": 1},
                                    {"method": ["medusa"], "num_speculative_tokens": 1}])
def test_a_recorded_method_that_is_not_a_drafter_is_refused_naming_the_field(tmp_path, record):
    (tmp_path / "vllm_speculative.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"vllm_speculative\.json: method must be one of \['medusa', 'eagle3'\]"):
        tuned_speculative_tokens(tmp_path, "medusa")


def test_a_recorded_length_beyond_the_medusa_heads_is_refused_naming_the_file(tmp_path):
    target = make_tiny_model(num_hidden_layers=8)
    export = save_export(MedusaHeads(HeadsSpec(2, 1, 32, VOCAB)), tmp_path / "medusa", "org/tiny", base_model=target)
    (export / "vllm_speculative.json").write_text(json.dumps({"method": "medusa", "num_speculative_tokens": 5}))
    with pytest.raises(ValueError, match=r"vllm_speculative\.json: num_speculative_tokens=5 exceeds the export's 2 "
                                         r"heads; rerun benchmarks/serve_vllm\.py --record"):
        speculative_config(export)
    assert speculative_config(export, 1)["num_speculative_tokens"] == 1  # a setting wins over the file
    assert speculative_config(export, recorded=False)["num_speculative_tokens"] == 2


def test_record_refuses_an_export_that_is_not_a_local_folder_in_its_arguments(tmp_path, capsys):
    script = serve_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--export", "org/name", "--record"])
    assert "--record writes into the export folder: org/name is not a local folder" in capsys.readouterr().err
    assert script.parse_args(["--export", str(tmp_path), "--record"]).record
