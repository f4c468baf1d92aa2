"""inference's presets live in inference/conf and find medusa_train's (model/, the schemas) through their primary
configs' hydra.searchpath; a user's hydra.searchpath on the command line, which Hydra lets replace that list, keeps
them (medusa_train.cli.app.kept_searchpath), and the user's own presets win."""

from hydra import compose, initialize_config_dir

from inference.cli.evaluate import register_schemas
from inference.conf import CONF_DIR, SHARED_CONF
from medusa_train.cli.app import kept_searchpath
from medusa_train.files.paths import CONF_DIR as TRAIN_CONF_DIR

register_schemas()


def test_a_command_line_searchpath_keeps_the_primary_configs_entries(tmp_path):
    mine = f"file://{tmp_path}"
    evaluate = CONF_DIR / "evaluate.yaml"
    assert kept_searchpath(["max_new_tokens=8", f"hydra.searchpath=[{mine}]"], evaluate) == \
        ["max_new_tokens=8", f"hydra.searchpath=[{mine},{SHARED_CONF}]"]
    assert kept_searchpath([f"hydra.searchpath=[{SHARED_CONF}]"], evaluate) == [f"hydra.searchpath=[{SHARED_CONF}]"]
    assert kept_searchpath([f"++hydra.searchpath=[{mine}, {SHARED_CONF}]"], evaluate) == \
        [f"++hydra.searchpath=[{mine},{SHARED_CONF}]"]
    train = TRAIN_CONF_DIR / "train.yaml"  # no searchpath of its own: a user's is left as given
    assert kept_searchpath([f"hydra.searchpath=[{mine}]"], train) == [f"hydra.searchpath=[{mine}]"]


def test_the_users_presets_and_the_shared_ones_both_compose(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("defaults:\n  - /schema/model/base@_here_\n  - _self_\n"
                                                 "name_or_path: my/own-model\n")
    overrides = kept_searchpath([f"hydra.searchpath=[file://{tmp_path}]", "output_dir=out"], CONF_DIR / "evaluate.yaml")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        mine = compose("evaluate", overrides=[*overrides, "model=mine"])
        shared = compose("evaluate", overrides=[*overrides, "model=smollm2_135m", "draft=self_layers"])
    assert mine.model.name_or_path == "my/own-model"
    assert shared.model.format == "gguf" and shared.draft.kind == "self_layers"
