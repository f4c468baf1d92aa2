"""Renamed names keep working with a FutureWarning (``medusa_train/config/renames.py``; README, "Renamed names"): old keys
and values on the command line, an old run's ``train_config.yaml``, and the tree decoder's old name ``medusa``."""

from __future__ import annotations

import pytest

from medusa_train.config.renames import RENAMED_DECODERS, decoder_alias, renamed_config, renamed_overrides


def test_old_keys_and_values_on_the_command_line_become_the_new_ones_with_a_warning():
    with pytest.warns(FutureWarning, match=r"key heads.medusa_num_heads is now heads.num_heads"):
        new = renamed_overrides(["heads.medusa_num_heads=3", "+heads.medusa_num_layers=2", "heads=medusa2"])
    assert new == ["heads.num_heads=3", "+heads.num_layers=2", "heads=medusa2"]  # the presets keep their names
    with pytest.warns(FutureWarning, match=r"value heads.mode=medusa2 is now heads.mode=joint"):
        assert renamed_overrides(["-m", "heads.mode=medusa1,medusa2"]) == ["-m", "heads.mode=frozen_base,joint"]


def test_new_names_and_everything_else_pass_unchanged_without_a_warning(recwarn):
    args = ["heads.num_heads=3", "heads.mode=joint", "decoders=[vanilla,medusa]", "--cfg", "job",
            "decoder.medusa.topk=4", "data.path=/a=b"]
    assert renamed_overrides(args) == args
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_an_old_run_record_reads_under_the_new_names_silently(recwarn):
    saved = {"heads": {"medusa_num_heads": 2, "medusa_num_layers": 1, "mode": "medusa2"}, "output_dir": "x"}
    assert renamed_config(saved) == {"heads": {"num_heads": 2, "num_layers": 1, "mode": "joint"}, "output_dir": "x"}
    assert saved["heads"]["mode"] == "medusa2"  # a copy
    assert not recwarn.list


def test_the_tree_decoders_old_name_runs_the_same_decoder_under_its_own_name():
    from inference.registry import REGISTRY, check_decoder_names, decoder_settings

    assert RENAMED_DECODERS == {"medusa": "tree"}
    assert REGISTRY["medusa"].settings is REGISTRY["tree"].settings and not REGISTRY["medusa"].default
    with pytest.warns(FutureWarning, match=r"decoder medusa is now tree"):
        assert check_decoder_names(["vanilla", "medusa"]) == ["vanilla", "medusa"]
    with pytest.warns(FutureWarning):
        assert decoder_settings("medusa", {"topk": 4}).topk == 4
    assert decoder_alias("tree") is None


def test_a_train_config_with_the_old_names_composes_through_the_command_line_rewrite(tmp_path):
    from tests.medusa_train.test_training import compose_train

    with pytest.warns(FutureWarning):
        overrides = renamed_overrides([f"output_dir={tmp_path}", "heads.medusa_num_heads=2", "heads.mode=medusa1"])
    cfg = compose_train(overrides)
    assert cfg.heads.num_heads == 2 and cfg.heads.mode == "frozen_base"
