"""launch/install.sh: a venv that holds another checkout's editable install is refused, not repointed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _install(venv: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEDUSA_VENV": str(venv)}
    return subprocess.run(["bash", str(ROOT / "launch" / "install.sh")], env=env, capture_output=True, text=True,
                          timeout=60)


def test_another_checkouts_venv_is_refused_before_anything_is_installed(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".medusa-checkout").write_text("/elsewhere/medusa-train\n")
    (venv / ".medusa-installed").write_text("a stamp of other scripts\n")
    result = _install(venv)
    assert result.returncode == 2
    assert "/elsewhere/medusa-train" in result.stderr and str(ROOT) in result.stderr
    assert "unset MEDUSA_VENV" in result.stderr
    assert sorted(p.name for p in venv.iterdir()) == [".medusa-checkout", ".medusa-installed"]  # nothing created
    assert (venv / ".medusa-checkout").read_text() == "/elsewhere/medusa-train\n"


def test_the_running_venv_records_its_checkout_and_is_current():
    venv = Path(sys.prefix)
    owner = venv / ".medusa-checkout"
    assert owner.is_file(), f"launch/install.sh records the checkout it installed in {owner}"
    if owner.read_text().strip() != str(ROOT):
        pytest.skip(f"these tests run from {ROOT} in the venv of {owner.read_text().strip()} (PYTHONPATH)")
    result = _install(venv)  # the stamp matches: a no-op
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
