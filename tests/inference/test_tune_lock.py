"""medusa-tune-tree holds the export folder's lock: a tuning is refused while another process holds it (a second
tuning, or an export being written), before any model loads, and writes nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from inference.cli.tune_tree import register_schemas
from inference.conf import CONF_DIR
from medusa_train.runs.run_lock import EXPORT_LOCK, LockHeldError

register_schemas()
REPO_ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys
from medusa_train.runs.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1], sys.argv[2])
print("held", flush=True)
sys.stdin.read()  # hold until the test closes stdin
lock.release()
"""


def start_holder(folder: Path, name: str) -> subprocess.Popen:
    """Another process holding ``folder``'s lock file ``name`` until its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_tune_tree_is_refused_while_another_process_holds_the_export(tmp_path, monkeypatch):
    import medusa_train.loading.runtime as runtime
    from inference.cli.tune_tree import run

    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    monkeypatch.setattr(runtime, "load_for_inference", lambda *a, **k: pytest.fail("loaded a model"))
    holder = start_holder(export, EXPORT_LOCK)
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("tune_tree", overrides=[f"export_dir={export}"])
        with pytest.raises(LockHeldError, match=f"export_dir {export} is in use by another run: pid {holder.pid} "
                                                f"on host {socket.gethostname()}"):
            run(cfg)
        assert sorted(p.name for p in export.iterdir()) == ["config.json", EXPORT_LOCK]
        assert json.loads((export / EXPORT_LOCK).read_text())["pid"] == holder.pid  # the holder's lock is intact
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert sorted(p.name for p in export.iterdir()) == ["config.json"]
