"""launch/recipe_scale.py (the data-scaling cell's recipe) and launch/recipe_settings.py (the settings it shares
with the quickstart): the cell's overrides, a finished stage skipped, a cut one resumed, a folder trained with other
settings refused before anything runs, and the settings printed for bash read back as the same arrays."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CODER = {"SCALE_MODEL": "qwen2_5_coder_1_5b", "SCALE_MODEL_DTYPE": "bfloat16", "SCALE_CODE_SHARE": "0.5",
         "SCALE_EXCLUDE": "humaneval"}


@pytest.fixture()
def recipe(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "launch"))
    spec = importlib.util.spec_from_file_location("recipe_scale", REPO_ROOT / "launch" / "recipe_scale.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "recipe_scale", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setenv("MEDUSA_VLLM_VENV", "/nonexistent")  # vLLM absent: the settings do not depend on this machine
    return module


def test_a_cell_trains_with_the_quickstarts_settings_and_its_knobs(recipe, tmp_path):
    cell = recipe.cell(["eagle3", "2"], {"SCALE_OUT": str(tmp_path), "SCALE_TTT_STEPS": "4", **CODER})
    run = tmp_path / "eagle3-2"
    assert cell.run == run and cell.replies == tmp_path / "replies-2" and cell.knobs.epochs == 5
    assert cell.train[:6] == ["model=qwen2_5_coder_1_5b", "model.dtype=bfloat16", "data=sharegpt",
                              "data.self_distill=true", "data.self_distill_engine=vllm", "data.self_distill_dtype=auto"]
    assert "data.code_share=0.5" in cell.train and "data.exclude_prompts=[humaneval]" in cell.train
    assert "data.max_conversations=1400" in cell.train and "trainer.num_train_epochs=5" in cell.train
    assert cell.train[-4:] == ["heads=eagle3", "heads.num_heads=4", f"data.self_distill_dir={tmp_path / 'replies-2'}",
                               f"output_dir={run}"]
    assert cell.tune[0] == f"export_dir={run / 'export'}" and cell.tune[-2:] == ["dynamic_depths=[3,5]", "dynamic_topks=[8]"]
    assert recipe.cell(["medusa", "16"], {}).knobs.epochs == 2 and recipe.cell(["hydra", "4"], {}).train[-4] == "heads=hydra"
    tagged = recipe.cell(["medusa", "1"], {"SCALE_OUT": str(tmp_path), "SCALE_TAG": "v8192", "SCALE_HEAD_VOCAB": "8192"})
    assert tagged.run == tmp_path / "medusa-1-v8192" and "heads.head_vocab_size=8192" in tagged.train


@pytest.mark.parametrize("argv, env, message", [
    (["medusa"], {}, "usage: bash launch/recipe_scale.sh DRAFTER SIZE"),
    (["medusa", "0"], {}, "SIZE=0: give a positive integer"),
    (["medusa", "1"], {"SCALE_EPOCHS": "two"}, "SCALE_EPOCHS=two: give a positive integer"),
    (["medusa", "1"], {"SCALE_HEAD_VOCAB": "-1"}, "SCALE_HEAD_VOCAB=-1: give a positive integer"),
    (["medusa", "1"], {"SCALE_DISTILL_ENGINE": "sglang"}, "SCALE_DISTILL_ENGINE=sglang: choose vllm or hf"),
])
def test_a_bad_cell_is_refused_naming_the_setting(recipe, argv, env, message):
    with pytest.raises(recipe.RecipeError, match=message):
        recipe.cell(argv, env)


def finished_export(run: Path) -> None:
    (run / "export").mkdir(parents=True, exist_ok=True)
    (run / "export" / "config.json").write_text("{}")


def test_stages_skip_what_finished_resume_what_was_cut_and_refuse_other_settings(recipe, tmp_path, monkeypatch):
    env = {"SCALE_OUT": str(tmp_path), "SCALE_DISTILL_ENGINE": "hf"}
    cell = recipe.cell(["medusa", "1"], env)
    (train, command, record), (tune, tune_command, _) = recipe.commands(cell)
    assert (train, tune) == ("train", "tune") and command[-1] == "resume=false" and record == {"train": cell.train}
    assert command[:-1] == ["medusa-train", *cell.train] and tune_command == ["medusa-tune-tree", *cell.tune]

    (cell.run / "checkpoints").mkdir(parents=True)  # a killed run: resumed
    assert recipe.commands(cell)[0][1][-1] == "resume=true"

    finished_export(cell.run)
    recipe.write_stamp(cell.run / recipe.TRAINED, record)
    assert recipe.commands(cell)[0][1] is None  # trained: not again
    assert recipe.commands(cell)[1][1] is not None  # not tuned yet
    recipe.write_stamp(cell.run / recipe.TUNED)
    assert [c for _, c, _ in recipe.commands(cell)] == [None, None]
    assert not list(cell.run.glob("*.partial"))

    other = recipe.cell(["medusa", "1"], {**env, "SCALE_EPOCHS": "2"})  # the same folder, other settings
    with pytest.raises(recipe.RecipeError, match="trainer.num_train_epochs=5' then, 'trainer.num_train_epochs=2' now"):
        recipe.commands(other)
    monkeypatch.chdir(tmp_path)  # main() works from the checkout; the test's folder comes back after
    assert recipe.main(["medusa", "1"], {**env, "SCALE_EPOCHS": "2"}) == 2  # before install.sh or any run


def test_medusa_and_hydra_of_a_size_share_one_hidden_cache_and_eagle3_keeps_its_own(recipe, tmp_path):
    from medusa_train.models.catalog import drafter_type
    from medusa_train.models.features import FINAL

    env = {"SCALE_OUT": str(tmp_path), "SCALE_DISTILL_ENGINE": "hf"}
    caches = {d: [a for a in recipe.cell([d, "1"], env).train if a.startswith("hidden_cache_dir=")]
              for d in ("medusa", "hydra", "eagle3")}
    assert caches == {"medusa": [f"hidden_cache_dir={tmp_path / 'hidden-1'}"],
                      "hydra": [f"hidden_cache_dir={tmp_path / 'hidden-1'}"], "eagle3": []}
    tagged = recipe.cell(["hydra", "1"], {**env, "SCALE_TAG": "code"}).train[-1]
    assert tagged == f"hidden_cache_dir={tmp_path / 'hidden-1-code'}"  # a tag's data may differ: its own cache
    # the recipe's list agrees with the catalog: the drafters sharing a cache read the last hidden state only
    assert all(drafter_type(d).features == (FINAL,) and drafter_type(d).features_of is None
               for d in recipe.SHARED_CACHE)
    assert drafter_type("eagle3").features_of is not None


def test_a_run_trained_before_its_cache_moved_is_still_trained(recipe, tmp_path):
    cell = recipe.cell(["medusa", "1"], {"SCALE_OUT": str(tmp_path), "SCALE_DISTILL_ENGINE": "hf"})
    finished_export(cell.run)
    before = [a for a in cell.train if not a.startswith("hidden_cache_dir=")]  # its cache was in its own folder
    recipe.write_stamp(cell.run / recipe.TRAINED, {"train": before})
    assert recipe.commands(cell)[0][1] is None
    recipe.write_stamp(cell.run / recipe.TRAINED, {"train": before[:-2] + ["data.max_length=64", *before[-1:]]})
    with pytest.raises(recipe.RecipeError, match="'data.max_length=64' then, 'data.self_distill_dir="):
        recipe.commands(cell)


@pytest.mark.parametrize("stamp", ['{"train": null}', '{"train": [1, 2]}', '[]', 'null', '{not json'])
def test_a_stamp_the_recipe_did_not_write_is_refused_in_one_line(recipe, tmp_path, stamp):
    cell = recipe.cell(["medusa", "1"], {"SCALE_OUT": str(tmp_path), "SCALE_DISTILL_ENGINE": "hf"})
    finished_export(cell.run)
    (cell.run / recipe.TRAINED).write_text(stamp)
    with pytest.raises(recipe.RecipeError, match="is not a stamp this recipe wrote"):
        recipe.commands(cell)


def test_a_retrained_export_is_tuned_again(recipe, tmp_path):
    import os

    cell = recipe.cell(["hydra", "1"], {"SCALE_OUT": str(tmp_path), "SCALE_DISTILL_ENGINE": "hf"})
    finished_export(cell.run)
    recipe.write_stamp(cell.run / recipe.TRAINED, {"train": cell.train})
    recipe.write_stamp(cell.run / recipe.TUNED)
    stamp = (cell.run / recipe.TUNED).stat().st_mtime
    os.utime(cell.run / "export" / "config.json", (stamp + 10, stamp + 10))
    assert recipe.commands(cell)[1][1] == ["medusa-tune-tree", *cell.tune]


def test_a_shell_recipes_stamp_is_trusted(recipe, tmp_path):
    cell = recipe.cell(["medusa", "1"], {"SCALE_OUT": str(tmp_path), "SCALE_DISTILL_ENGINE": "hf"})
    finished_export(cell.run)
    (cell.run / recipe.TRAINED).write_text("")  # `touch trained.stamp`: it recorded nothing
    assert recipe.commands(cell)[0][1] is None


def test_the_settings_read_back_in_bash_as_the_same_arrays(recipe, tmp_path):
    settings = recipe.overrides(recipe.RecipeKnobs(conversations=700, epochs=5))
    script = ('eval "$(python3 launch/recipe_settings.py --conversations 700 --epochs 5)"; '
              'for name in train tune tune_eagle3 evaluate; do eval "printf \'%s\\n\' \\"\\${$name[@]}\\""; '
              'echo --; done; echo "$engine $vllm_ready"; mkdir -p "$0/export"; resumes "$0"; resumes "$0/none"')
    done = subprocess.run(["bash", "-c", script, str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin", "MEDUSA_VLLM_VENV": "/nonexistent"})
    blocks = done.stdout.split("--\n")
    assert [b.splitlines() for b in blocks[:4]] == [settings[k] for k in ("train", "tune", "tune_eagle3", "evaluate")]
    assert blocks[4].splitlines() == ["hf false", "true", "false"]
    assert "latency_sizes=[1,2,4,8,12,16,24,32]" in settings["tune"] and "data.self_distill_engine=hf" in settings["train"]
    assert "self-distillation engine: hf" in done.stderr
    bad = subprocess.run([sys.executable, "launch/recipe_settings.py", "--conversations", "0", "--epochs", "5"],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--conversations: 0: give a positive integer" in bad.stderr
