"""Config schemas and resolvers are registered by the entry points, never as a side effect of an import.

Each check runs in a fresh interpreter (this one has composed configs already): importing ``medusa_train``,
``inference`` and every module under them leaves Hydra's ConfigStore without any schema of ours and OmegaConf without
our resolvers; each console script's ``register_schemas`` then registers them, and again without error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

REGISTERED = """
import importlib, json, pkgutil, sys
import medusa_train, inference
found = {"cheap": sorted(m for m in ("torch", "transformers", "hydra", "omegaconf") if m in sys.modules)}
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

def nodes(repo, prefix=""):
    for key, value in repo.items():
        if isinstance(value, dict):
            yield from nodes(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value

def ours():
    from medusa_train.cli.resolvers import RESOLVER_NAMES
    schemas = sorted(path for path, node in nodes(ConfigStore.instance().repo)
                     if path.split("/")[0] == "schema" or path.endswith("_schema.yaml")
                     or getattr(OmegaConf.get_type(node.node), "__module__", "").split(".")[0]
                     in ("medusa_train", "inference"))
    return {"schemas": schemas, "resolvers": [n for n in RESOLVER_NAMES if OmegaConf.has_resolver(n)]}

for package in (medusa_train, inference):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
found["imported"] = ours()
for target in sys.argv[1:]:
    register = importlib.import_module(target.split(":")[0]).register_schemas
    register()
    register()  # idempotent
found["registered"] = ours()
print(json.dumps(found))
"""


@pytest.mark.slow
def test_imports_register_nothing_and_the_entry_points_register_their_schemas():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    run = subprocess.run([sys.executable, "-c", REGISTERED, *scripts.values()], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["cheap"] == []  # `import medusa_train` / `import inference` load no framework
    assert found["imported"] == {"schemas": [], "resolvers": []}
    registered = found["registered"]
    assert registered["resolvers"] == ["medusa.asset", "medusa.package", "medusa.auto_trainer",
                                       "medusa.installed_model"]
    assert {"schema/train.yaml", "schema/model/base.yaml", "schema/decoder/medusa.yaml", "evaluate_schema.yaml",
            "tune_tree_schema.yaml", "generate_schema.yaml"} <= set(registered["schemas"])
