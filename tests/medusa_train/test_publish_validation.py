"""What ``medusa-publish`` writes into a card and a published config.json is a name the Hub takes, never text: the
base model, the repository id and a local base's name are validated (huggingface_hub's ``validate_repo_id``) before
anything is read or written."""

from __future__ import annotations

import pytest
import torch

from medusa_train.export import save_export
from medusa_train.models.heads_base import HeadsSpec
from medusa_train.drafters.medusa.heads import MedusaHeads
from medusa_train.publish import prepare_repo_folder
from medusa_train.publish.publish_config import PublishConfig
from tests.conftest import HIDDEN, VOCAB, make_tiny_model


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    heads = MedusaHeads(HeadsSpec(2, 1, HIDDEN, VOCAB))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("validation") / "export"
    save_export(heads, folder, "alice/tiny-base", base_model=make_tiny_model("llama"), vllm=False)
    return folder


@pytest.mark.parametrize("base_model", ["alice/base\n# heading", "alice/base\n", "base`\"; rm -rf ~"])
def test_a_base_model_that_is_not_a_name_is_refused_before_anything_is_written(export, tmp_path, base_model):
    out = tmp_path / "repo"
    with pytest.raises(ValueError, match=r"(?s)^base_model '.*' is not a valid model name as the Hub validates them"):
        prepare_repo_folder(export, out, "alice/heads", base_model=base_model, license="mit")
    assert not out.exists()


def test_an_invalid_repo_id_is_refused_naming_the_field(export, tmp_path):
    out = tmp_path / "repo"
    with pytest.raises(ValueError, match=r"repo_id 'alice/heads\\n# x' is not a valid Hub repository name"):
        prepare_repo_folder(export, out, "alice/heads\n# x", license="mit")
    assert not out.exists()
    with pytest.raises(ValueError, match=r"repo_id 'alice/bad name' is not a valid Hub repository name"):
        PublishConfig(export_dir=str(export), repo_id="alice/bad name").validate()
    with pytest.raises(ValueError, match=r"^base_model 'a\\nb' is not a valid model name"):
        PublishConfig(export_dir=str(export), repo_id="alice/heads", base_model="a\nb").validate()


def test_a_local_base_whose_name_is_not_a_model_name_is_refused(tmp_path):
    heads = MedusaHeads(HeadsSpec(2, 1, HIDDEN, VOCAB))
    export = tmp_path / "export"
    save_export(heads, export, str(tmp_path / "my base\n## Injected"), base_model=make_tiny_model("llama"),
                vllm=False)
    with pytest.raises(ValueError, match=r"(?s)the name of the local base model at .*: 'my base\\n## Injected' is not "
                                         r"a valid model name.*publish with base_model=<Hub id of the base model>"):
        prepare_repo_folder(export, tmp_path / "repo", license="mit")
    assert not (tmp_path / "repo").exists()
    prepare_repo_folder(export, tmp_path / "fixed", base_model="alice/tiny-base", license="mit")
    card = (tmp_path / "fixed" / "README.md").read_text()
    assert "Injected" not in card and "base_model: alice/tiny-base" in card
