"""The dependency rules of the code base, checked on the source (every import, including those inside functions).

- no import cycle among the modules of ``medusa_train`` and ``inference``;
- ``medusa_train`` is the lower floor: it imports nothing of ``inference`` (the tree core, ``medusa_train.tree``, and
  the engines, ``medusa_train.engines``, sit below both; the tree tuner, ``inference.tuning``, decodes from above);
- the drafter folders (``medusa_train.drafters``) sit above the catalog, the model, export and the engines, which
  import none of them, and ``inference`` reaches them through the catalog only;
- ``inference`` imports nothing from ``medusa_train``'s training, publish or data packages, directly or through any
  module it imports (transitively);
- ``inference.proposers`` imports nothing of ``inference.decoders`` (the decoders drive the proposers);
- training imports nothing from publish; only entry points (``medusa_train.cli``, ``inference.cli``, ``benchmarks``)
  and publish itself import publish;
- no file cites a document outside the repository (a clone has none of them).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("medusa_train", "inference")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph(known: dict[str, Path], roots: tuple[str, ...] = PACKAGES,
                 files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the known modules it imports (a name resolves to its longest known prefix)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in (files or known).items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] not in roots:
                    continue
                parts = target.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    edges[name].add(".".join(parts))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def edges_between(edges: dict[str, set[str]], source: str, targets: tuple[str, ...]) -> list[str]:
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(f"{a} -> {b}" for a, bs in edges.items() if within(a, source) for b in bs
                  if any(within(b, t) for t in targets))


def test_no_import_cycle():
    assert cycles(import_graph(modules())) == []


def test_medusa_train_imports_nothing_of_inference():
    """No arrow runs back up: not even a function-level import (a lazy one is an arrow all the same)."""
    assert edges_between(import_graph(modules()), "medusa_train", ("inference",)) == []


# What the drafter folders (medusa_train.drafters.<name>) build on: the catalog loads them by name (BUILTIN_MODULES),
# and these floors import none of them, so that a folder can hold its export writer and serving mapping.
BELOW_THE_DRAFTERS = ("medusa_train.models.catalog", "medusa_train.models.heads_base", "medusa_train.tree",
                      "medusa_train.models.features", "medusa_train.models.speculative", "medusa_train.export",
                      "medusa_train.engines")


def test_nothing_below_the_drafter_folders_and_nothing_of_inference_imports_one():
    """The tree core, the catalog, the shared spec, the model, export and the engines' environments import no drafter
    folder (they ask the catalog), and neither does ``inference``: the tree decoder, the tuner and the engines'
    decoders reach a drafter through its catalog entry only."""
    edges = import_graph(modules())
    found = [e for source in (*BELOW_THE_DRAFTERS, "inference") for e in
             edges_between(edges, source, ("medusa_train.drafters",))]
    assert found == []


TRAINING_SIDE = tuple(f"medusa_train.{p}" for p in ("training", "publish", "data"))


def test_inference_imports_no_training_publish_or_data():
    forbidden = TRAINING_SIDE
    assert edges_between(import_graph(modules()), "inference", forbidden) == []


def reachable_paths(edges: dict[str, set[str]], known: dict[str, Path], sources: list[str]) -> dict[str, list[str]]:
    """module -> one import path to it from ``sources`` (breadth first over ``edges``); importing ``a.b.c`` runs
    ``a/__init__`` and ``a/b/__init__`` too, so a module's parent packages are reached with it."""
    path_to = {s: [s] for s in sources}
    queue = list(sources)
    while queue:
        module = queue.pop(0)
        parts = module.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))} & known.keys()
        for nxt in sorted(edges.get(module, set()) | parents):
            if nxt not in path_to:
                path_to[nxt] = path_to[module] + [nxt]
                queue.append(nxt)
    return path_to


def test_inference_reaches_no_training_publish_or_data_transitively():
    """Not even through a core module: every module an ``inference`` module imports, and what that imports, and so
    on (function-level imports included), stays outside the training-side packages."""
    known = modules()
    forbidden = TRAINING_SIDE
    reached = reachable_paths(import_graph(known), known, sorted(m for m in known if m.split(".")[0] == "inference"))
    offending = sorted(" -> ".join(path) for module, path in reached.items()
                       if any(module == f or module.startswith(f + ".") for f in forbidden))
    assert offending == [], "inference reaches training-side code:\n" + "\n".join(offending)


def test_the_proposers_import_nothing_of_the_decoders():
    """The decoders drive the proposers, never the other way round: a proposer reads the request
    (:class:`inference.decode_config.DecodeConfig`) from below both, so the two packages form no loop."""
    edges = import_graph(modules())
    assert edges_between(edges, "inference.proposers", ("inference.decoders",)) == []
    readers = edges_between(edges, "inference.proposers", ("inference.decode_config",))
    assert "inference.proposers.draft_model -> inference.decode_config" in readers


def test_only_entry_points_import_publish():
    known = modules()
    scripts = {f"benchmarks.{p.stem}": p for p in (ROOT / "benchmarks").glob("*.py")}
    edges = import_graph(known, files={**known, **scripts})
    importers = {a.split(" -> ")[0] for a in edges_between(edges, "", ("medusa_train.publish",))}
    entry = ("medusa_train.cli.", "inference.cli.", "benchmarks.", "medusa_train.publish")
    assert sorted(m for m in importers if not m.startswith(entry)) == []
    assert edges_between(edges, "medusa_train.training", ("medusa_train.publish",)) == []


def test_the_graph_sees_imports_inside_functions(tmp_path):
    """The rules above would pass vacuously if lazy imports were missed: a function-level import is an edge."""
    (tmp_path / "a.py").write_text("def f():\n    from medusa_train.publish import hub\n")
    edges = import_graph(modules(), files={"medusa_train.fake": tmp_path / "a.py"})
    assert edges["medusa_train.fake"] == {"medusa_train.publish", "medusa_train.publish.hub"}
    assert cycles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [["x", "y"]]


OUTSIDE_DOCS = re.compile(r"\b(DESIGN|NOTES|STYLE|DEVELOPERS)\.md\b|\.\./shared/(?!assets\b)")


def test_no_file_cites_a_document_outside_the_repository():
    suffixes = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg"}
    skip = {".git", ".venv", ".venv-vllm", ".venv-fasterdecoding", "runs", "__pycache__"}
    cited = []
    for path in ROOT.rglob("*"):
        if path.suffix not in suffixes or skip & set(path.relative_to(ROOT).parts) or path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE_DOCS.search(line):
                cited.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert cited == []


def test_no_module_defines_a_top_level_name_twice():
    """A second ``def`` of the same name silently replaces the first (a merge can leave one behind)."""
    twice = []
    for name, path in modules().items():
        seen: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in seen:
                    twice.append(f"{name}.{node.name}")
                seen.add(node.name)
    assert twice == []
