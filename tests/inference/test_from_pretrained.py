from __future__ import annotations

import json

import torch

from inference.decoders import DecodeConfig
from inference.decoders.tree import TreeDecoder
from inference.decoders.vanilla import VanillaDecoder
from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def test_from_pretrained_export_folder_uses_its_tree_and_matches_greedy(tmp_path):
    base = make_tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    make_tiny_tokenizer().save_pretrained(tmp_path / "base")
    heads = new_heads_for(base, num_heads=2)
    save_export(heads, tmp_path / "export", str(tmp_path / "base"),
                extra_config=export_extra_config(ModelConfig(name_or_path=str(tmp_path / "base"))))
    tree = [[0], [1], [0, 0]]
    (tmp_path / "export" / "medusa_choices.json").write_text(json.dumps(tree))

    decoder = TreeDecoder.from_pretrained(str(tmp_path / "export"), topk=4)
    assert [list(p) for p in decoder.tree.paths] == tree
    prompt = torch.tensor([[1, 10, 20, 30]])
    config = DecodeConfig(max_new_tokens=16)
    assert decoder.generate(prompt, config).tokens == VanillaDecoder(base).generate(prompt, config).tokens
