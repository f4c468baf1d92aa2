"""An export's config.json cannot make us run code: ``trust_remote_code`` comes from the user only.

The base folder holds a custom modeling file (``auto_map`` in its config.json) that writes a marker file when Python
imports it; the export records ``trust_remote_code: true``. Loading the export through every front door
(``medusa-generate``, :func:`load_for_inference` as ``medusa-eval`` and ``medusa-tune-tree`` do, and
``TreeDecoder.from_pretrained``) must not import it; asking explicitly does.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import transformers.dynamic_module_utils
from hydra import compose, initialize_config_dir

from inference.cli.generate import register_schemas, run
from inference.decoders.tree import TreeDecoder
from medusa_train.config.schema import ModelConfig
from medusa_train.export import save_export
from medusa_train.loading.export import export_extra_config, load_export
from medusa_train.loading.runtime import load_for_inference
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from tests.conftest import make_tiny_model, make_tiny_tokenizer

register_schemas()

MODULE = """
from pathlib import Path
Path({marker!r}).write_text("imported")
from transformers import {base_class}
class EvilForCausalLM({base_class}):
    pass
"""


def make_export(tmp_path: Path, model_type: str = "llama") -> tuple[Path, Path, Path]:
    """(export, base folder, marker path): the base has custom code; the export records trust_remote_code true."""
    base_dir, marker = tmp_path / "base", tmp_path / "imported.marker"
    base = make_tiny_model("llama")
    base.save_pretrained(base_dir)
    make_tiny_tokenizer().save_pretrained(base_dir)
    config = json.loads((base_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}  # the model class only
    config["model_type"] = model_type
    (base_dir / "config.json").write_text(json.dumps(config))
    (base_dir / "modeling_evil.py").write_text(MODULE.format(marker=str(marker), base_class="LlamaForCausalLM"))
    export = tmp_path / "export"
    cfg = ModelConfig(name_or_path=str(base_dir), trust_remote_code=True)
    save_export(new_heads_for(base, num_heads=2), export, str(base_dir), extra_config=export_extra_config(cfg),
                vllm=False)
    assert json.loads((export / "config.json").read_text())["medusa_train_model"]["trust_remote_code"] is True
    return export, base_dir, marker


@pytest.fixture(autouse=True)
def modules_cache(tmp_path, monkeypatch):
    """transformers copies remote code here before importing it: keep it out of the user's cache."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))


def _generate_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("generate", overrides=[*overrides, "dtype=float32", "max_new_tokens=4"])


def test_medusa_generate_does_not_run_the_code_an_export_asks_for(tmp_path):
    export, _, marker = make_export(tmp_path)
    # a warning, not a log line: medusa-generate turns Hydra's logging off, and the user must still be told
    with pytest.warns(RuntimeWarning, match=r"records trust_remote_code=true for its base model: ignored, since "
                                            r"remote code runs only when you ask for it \(\+model.trust_remote_code"):
        result = run(_generate_cfg(f"export_dir={export}", "prompt=hi"), out=io.StringIO())
    assert len(result.tokens) == 4
    assert not marker.exists()


def test_eval_and_tune_loader_and_from_pretrained_do_not_run_it_either(tmp_path):
    export, _, marker = make_export(tmp_path)
    model, _, _, _ = load_for_inference(str(export), dtype="float32", echo=None)
    assert type(model.base).__name__ == "LlamaForCausalLM"
    decoder = TreeDecoder.from_pretrained(str(export), dtype="float32")
    assert type(decoder.model.base).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


def test_the_users_explicit_request_runs_it(tmp_path):
    export, _, marker = make_export(tmp_path)
    model, _, _ = load_export(str(export), dtype="float32", trust_remote_code=True)
    assert marker.read_text() == "imported" and type(model.base).__name__ == "EvilForCausalLM"


def test_the_command_lines_partial_model_setting_runs_it(tmp_path):
    export, _, marker = make_export(tmp_path)
    run(_generate_cfg(f"export_dir={export}", "prompt=hi", "+model.trust_remote_code=true"), out=io.StringIO())
    assert marker.read_text() == "imported"


def test_a_base_that_needs_its_code_says_how_to_allow_it(tmp_path):
    export, base_dir, marker = make_export(tmp_path, model_type="evil_custom")
    with pytest.raises(OSError, match=r"needs its own Python code.*pass model\.trust_remote_code=true"):
        load_for_inference(str(export), dtype="float32", echo=None)
    assert not marker.exists()
