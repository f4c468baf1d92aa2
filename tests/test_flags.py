"""Every numeric flag of the argparse scripts has its range stated once (``medusa_train.cli.flags``; a flag that sets
a config field takes that field's bound), and every value the range refuses is refused before any work in one line
naming the flag as typed, exit status 2, no traceback: the scripts' counterpart of ``test_schema_bounds.py``, which
walks ``medusa-train``'s settings."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from medusa_train.cli.flags import flag_of, numeric_flags
from medusa_train.files.paths import assets_dir

ROOT = Path(__file__).resolve().parents[1]
PROBES = {int: (0, -1, -3, 10**12), float: (0.0, -1.0, 1e12, math.nan, math.inf)}
# each script, and flags that make a run of it valid (a probe is appended: the last value of a flag wins)
SCRIPTS = {
    "memory_plan": ["--config", str(assets_dir() / "configs" / "llama-3.1-8b.json"), "--heads", "medusa", "--gpus",
                    "8", "--gpu-gib", "80", "--seq", "4096"],
    "data_scaling": [],
}


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases() -> list[tuple[str, str, object]]:
    found = []
    for name in SCRIPTS:
        script = load(name)
        for dest, kind in numeric_flags(script.build_parser()).items():
            found += [(name, dest, value) for value in PROBES[kind]]
    return found


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_numeric_flag_states_its_range(name):
    script = load(name)
    flags = numeric_flags(script.build_parser())
    assert flags and set(flags) == set(script.BOUNDS)


@pytest.mark.parametrize("name, dest, value", cases())
def test_every_value_a_flags_range_refuses_is_refused_in_one_line_naming_the_flag(name, dest, value, capsys,
                                                                                   monkeypatch):
    script = load(name)
    parser = script.build_parser()
    if script.BOUNDS[dest].admits(value):
        pytest.skip(f"{value!r} is in range")
    flag = flag_of(parser, dest)
    for work in ("plan", "measure", "render"):  # nothing may run
        if hasattr(script, work):
            monkeypatch.setattr(script, work, lambda *a, **k: pytest.fail(f"{flag} {value!r} reached {work}"))
    with pytest.raises(SystemExit) as e:
        script.main([*SCRIPTS[name], flag, str(value)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{name}.py: error: {flag} must be ") and err.endswith(f"got {value!r}\n"), err
