"""The entry points' shared front door (medusa_train/cli/app.py): a required setting missing from the command line
gets one line naming it and an example, exit status 2, before Hydra creates any folder."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ENTRY_POINTS = {  # module, its required settings, the example the message shows
    "medusa-tune-tree": ("inference.cli.tune_tree", ["export_dir"], "medusa-tune-tree export_dir="),
    "medusa-eval": ("inference.cli.evaluate", ["output_dir"], "medusa-eval export_dir="),  # or model=: checked later
    "medusa-generate": ("inference.cli.generate", ["export_dir", "prompt"], "medusa-generate export_dir="),
    "medusa-publish": ("medusa_train.cli.publish", ["export_dir"], "medusa-publish export_dir="),
}


def run_main(module: str, args: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main()
    return info.value.code


@pytest.mark.parametrize("command", sorted(ENTRY_POINTS))
def test_missing_required_settings_get_one_line_with_an_example(command, tmp_path, monkeypatch, capsys):
    module, required, example = ENTRY_POINTS[command]
    monkeypatch.chdir(tmp_path)
    assert run_main(module, [], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    names = " and ".join(required)
    assert err.startswith(f"{command}: {names} {'is' if len(required) == 1 else 'are'} required: add "
                          + " ".join(f"{k}=..." for k in required) + f" (e.g. {example}")
    assert list(tmp_path.iterdir()) == []  # nothing written: no Hydra run folder, no .tune_tree, no /hydra

    # one of two given: the other is named alone
    if len(required) == 2:
        assert run_main(module, [f"{required[0]}=somewhere"], monkeypatch) == 2
        assert capsys.readouterr().err.startswith(f"{command}: {required[1]} is required: add {required[1]}=...")


def test_complete_command_lines_reach_the_command_itself(tmp_path):
    # a process of its own: Hydra's run reconfigures logging (generate.yaml disables it), which must not leak here
    run = subprocess.run([sys.executable, "-m", "inference.cli.generate", f"export_dir={tmp_path / 'nowhere'}",
                          "prompt=hi"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 1 and "is not a folder (an export written by medusa-train)" in run.stderr


def export_gguf(*overrides: str) -> str:
    from hydra import compose, initialize_config_dir

    from medusa_train.cli.export_gguf import register_schemas, run
    from medusa_train.files.paths import CONF_DIR

    register_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return run(compose("export_gguf", overrides=list(overrides)))


def test_medusa_export_gguf_checks_outtype_then_the_export_folder_before_llamacpp(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_LLAMACPP_DIR", str(tmp_path / "no-llamacpp"))  # llama.cpp is not installed
    missing = tmp_path / "runs" / "nothing" / "export"
    with pytest.raises(ValueError, match=r"^outtype='q9_bogus': choose one of f32, f16, bf16, q8_0$"):
        export_gguf(f"export_dir={missing}", "outtype=q9_bogus")
    with pytest.raises(FileNotFoundError, match=rf"^export_dir {missing} is no such folder: it is not an export "
                                                r"written by medusa-train; pass the export folder of a training run"):
        export_gguf(f"export_dir={missing}")
    assert not missing.parent.exists()  # nothing written
