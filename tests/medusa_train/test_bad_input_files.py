"""Files we read from users fail early and by name: a file that is not UTF-8 names its line and byte, and every file
an export holds is checked when the export is opened, before any base model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.decoders.choices import resolve_medusa_choices
from medusa_train.chat.conversations import load_conversations
from medusa_train.data.self_distill import read_records
from medusa_train.export import load_heads, save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.loading.export import load_export
from medusa_train.chat.prompts import load_prompts
from tests.conftest import HIDDEN, VOCAB

LATIN1 = '{"question_id": 1, "turns": ["caf\xe9"]}\n'.encode("latin-1")  # byte 0xe9 is not UTF-8 here
COLUMN = LATIN1.index(b"\xe9") + 1  # 34


def test_a_prompts_file_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "prompts.jsonl"
    first = b'{"question_id": 0, "turns": ["hi"]}\n'
    path.write_bytes(first + LATIN1)
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text: byte 0xe9 at byte offset "
                                         rf"{len(first) + COLUMN - 1} "
                                         rf"\(byte {COLUMN} of line 2\) does not decode; save the file as UTF-8"):
        load_prompts("jsonl", str(path))


def test_a_medusa_choices_file_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "tree.json"
    path.write_bytes(b"[[0],\n [1], \xff]")
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text: byte 0xff at byte offset 12 \(byte 7 of line 2"):
        resolve_medusa_choices(str(path), str(tmp_path), 2, 4)


def test_self_distilled_records_that_are_not_utf8_name_the_file_line_and_byte(tmp_path):
    path = tmp_path / "distilled.jsonl"
    good = json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]})
    path.write_bytes(good.encode() + b"\n" + LATIN1)
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text: byte 0xe9 at byte offset {len(good) + COLUMN} "
                                         rf"\(byte {COLUMN} of line 2\)"):
        read_records(path)
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text: byte 0xe9"):
        load_conversations("json", path)


def test_an_export_config_that_is_not_utf8_names_the_file_line_and_byte(tmp_path):
    from medusa_train.export.files import read_json

    path = tmp_path / "config.json"
    path.write_bytes(b'{"medusa_num_heads": 2,\n "base_model_name_or_path": "caf\xe9"}')
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text: byte 0xe9 at byte offset 56 \(byte 33 of "
                                         r"line 2\)"):
        read_json(path)


# ---------------------------------------------------------------- every file of an export, checked when opened


@pytest.fixture
def export(tmp_path) -> Path:
    """Two heads for a base model folder that does not exist: any error about a file comes before loading it."""
    folder = tmp_path / "export"
    save_export(MedusaHeads(HeadsSpec(2, 1, HIDDEN, VOCAB)), folder, str(tmp_path / "no-such-base"), vllm=False)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name, content, message", [
    ("medusa_choices.json", [[0], [0, 0], [0, 0, 0]], r"medusa_choices\.json: medusa_choices\[2\] = \[0, 0, 0\]: "
                                                      r"depth 3 exceeds num_heads=2"),
    ("medusa_choices.json", [[0], [1, 0]], r"medusa_choices\.json: .*its prefix \[1\] is missing"),
    ("medusa_choices.json", [[VOCAB]], rf"medusa_choices\.json: .*rank {VOCAB} is outside"),
    ("head_accuracy.json", {"acc": [[0.5, 0.2]]}, r"head_accuracy\.json: 'acc' has 1 rows but the export has 2 heads"),
    ("head_accuracy.json", {"acc": [[0.5], [None]]}, r"head_accuracy\.json: acc\[1\]\[0\] = None: accuracies lie in"),
    ("latency_profile.json", {"device": "cpu", "dtype": "float32", "latency_ms": {"4": "fast"}},
     r"latency_profile\.json: latency_ms\['4'\] = 'fast'"),
    ("latency_profile.json", {"device": "cpu", "latency_ms": {"1": 2.0}}, r"latency_profile\.json has no \['dtype'\]"),
])
def test_a_malformed_tuned_file_fails_when_the_export_is_opened(export, name, content, message):
    (export / name).write_text(json.dumps(content))
    with pytest.raises(ValueError, match=rf"{export / name}|{message}") as raised:
        load_heads(export)
    assert str(export / name) in str(raised.value)
    with pytest.raises(ValueError, match=message):  # load_export: before the (missing) base model is looked at
        load_export(str(export))


def test_a_tuned_file_that_is_not_utf8_fails_when_the_export_is_opened(export):
    (export / "head_accuracy.json").write_bytes(b'{"acc": [[0.5], [0.25]], "prompt_source": "caf\xe9"}')
    with pytest.raises(ValueError, match=rf"^{export / 'head_accuracy.json'}:1: not UTF-8 text: byte 0xe9"):
        load_export(str(export))


@pytest.mark.parametrize("changes, message", [
    ({"medusa_num_heads": "2"}, r"config\.json: medusa_num_heads must be an integer, got '2'"),
    ({"medusa_num_layers": True}, r"config\.json: medusa_num_layers must be an integer, got True"),
    ({"base_model_name_or_path": ["a"]}, r"config\.json: base_model_name_or_path must be a string"),
    ({"medusa_train_model": "gpt2"}, r"config\.json: medusa_train_model must be an object"),
    ({"medusa_train_model": {"name_or_path": "x", "dtype": 3.5}}, r"config\.json: medusa_train_model"),
    ({"medusa_train_model": {"name_or_path": "x", "no_such_field": 1}}, r"config\.json: medusa_train_model is not a "
                                                                       r"model/ config"),
])
def test_config_json_fields_of_the_wrong_type_are_named_before_the_base_model_loads(export, changes, message):
    _edit_config(export, **changes)
    with pytest.raises(ValueError, match=message):
        load_export(str(export))
