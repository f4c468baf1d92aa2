"""``medusa-generate`` on a real tiny model (stories260K) with heads exported by ``save_export``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from inference.cli.generate import GenerateConfig, register_schemas, run
from inference.decoders import DecodeConfig, VanillaDecoder, default_medusa_choices
from inference.decoders.choices import resolve_medusa_choices
from medusa_train.config.schema import ModelConfig, as_dataclass
from medusa_train.export import save_export
from medusa_train.loading.base import load_base_model
from medusa_train.loading.export import export_extra_config
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from medusa_train.files.paths import assets_dir

register_schemas()  # what conf/generate.yaml composes from


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stories_export(tmp_path_factory):
    try:
        folder = assets_dir() / "stories260K"
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = ModelConfig(name_or_path=str(folder / "stories260K.bin"), format="llama2c",
                      tokenizer_path=str(folder / "tok512.bin"))
    base, tokenizer = load_base_model(cfg)
    heads = new_heads_for(base, 3)
    with torch.no_grad():
        heads.block_weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("export")
    save_export(heads, out, base_model_name_or_path=cfg.name_or_path, extra_config=export_extra_config(cfg),
                vllm=False)
    return out, base, tokenizer


def _compose(*overrides: str):
    # float32 unless a test asks otherwise: the replies are compared with a float32 VanillaDecoder's, and dtype=auto
    # would be bf16 on some CPUs and fp32 on others
    dtype = [] if any(o.startswith("dtype=") for o in overrides) else ["dtype=float32"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("generate", overrides=[*overrides, *dtype])


def test_generate_streams_the_greedy_reply_and_its_stats(stories_export):
    export, base, tokenizer = stories_export
    out = io.StringIO()
    result = run(_compose(f"export_dir={export}", "prompt=Once upon a time", "max_new_tokens=40",
                          "decoder.tree.medusa_choices=[[0],[0,0],[1],[0,0,0]]"), out=out)
    prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Once upon a time"}],
                                                     add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False).input_ids
    expected = VanillaDecoder(base).generate(prompt, DecodeConfig(max_new_tokens=40,
                                                                  eos_token_ids=(tokenizer.eos_token_id,))).tokens
    assert result.tokens == expected
    reply, stats = out.getvalue().rstrip("\n").rsplit("\n", 1)
    assert reply == tokenizer.decode(expected, skip_special_tokens=True) == result.text
    assert stats.startswith(f"[tree] {len(expected)} tokens in ")
    assert f"mean accepted tokens {result.mean_accepted_tokens:.2f}, {result.forward_passes} decoding passes" in stats


def test_tree_comes_from_the_setting_then_the_export_then_the_default(stories_export, tmp_path):
    export, _, _ = stories_export
    assert resolve_medusa_choices([[0], [1]], str(export), 3, 10) == [[0], [1]]
    assert resolve_medusa_choices(None, str(export), 3, 4) == default_medusa_choices(3, 4)
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "medusa_choices.json").write_text(json.dumps([[0], [0, 0]]))
    assert resolve_medusa_choices(None, str(tuned), 3, 10) == [[0], [0, 0]]
    assert resolve_medusa_choices(str(tuned / "medusa_choices.json"), "unused", 3, 10) == [[0], [0, 0]]
    with pytest.raises(FileNotFoundError, match="medusa_choices='nope.json'"):
        resolve_medusa_choices("nope.json", "unused", 3, 10)


@pytest.mark.parametrize("overrides,error,match", [
    (["temperature=0.7", "decoder.tree.acceptance=greedy"], ValueError, "acceptance=greedy"),
    (["decoder.tree.acceptance=lucky"], ValueError, "acceptance must be one of"),
    (["decoder_name=beam"], ValueError, "unknown decoder name"),
    (["top_p=1.5"], ValueError, "top_p"),
    (["max_new_tokens=0"], ValueError, "max_new_tokens"),
])
def test_bad_settings_fail_before_loading(tmp_path, overrides, error, match):
    cfg = _compose(f"export_dir={tmp_path}", "prompt=hi", *overrides)
    with pytest.raises(error, match=match):
        as_dataclass(GenerateConfig, cfg)


def test_missing_export_is_named():
    cfg = _compose("export_dir=/nonexistent/export", "prompt=hi")
    with pytest.raises(FileNotFoundError, match="/nonexistent/export"):
        as_dataclass(GenerateConfig, cfg)


def test_model_group_override_composes():
    cfg = _compose("export_dir=.", "prompt=hi", "model=stories260k")
    assert Path(cfg.model.name_or_path).name == "stories260K.bin" and cfg.model.format == "llama2c"


def test_sampling_with_speculative_acceptance_is_reproducible(stories_export):
    export, _, _ = stories_export
    overrides = (f"export_dir={export}", "prompt=Once upon a time", "max_new_tokens=24", "temperature=0.8",
                 "decoder.tree.acceptance=speculative", "decoder.tree.medusa_choices=[[0],[1],[0,0]]", "seed=3")
    first = run(_compose(*overrides), out=io.StringIO())
    assert run(_compose(*overrides), out=io.StringIO()).tokens == first.tokens
    assert len(first.tokens) == 24 or first.stop_reason == "eos"
