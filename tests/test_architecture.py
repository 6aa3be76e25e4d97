"""The shape of the package: no import cycle, nothing importing upward, and a module map (docs/architecture.md) that maps
every module. Built from the source with ``ast`` (imports inside functions count too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "include" / "regen"

# Bottom to top: a module may import its own layer (without a cycle) and the layers below.
# A module belongs to the longest prefix listed.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundations", ("regen.errors", "regen.units", "regen.childpool", "regen.modelconfig", "regen.machine", "regen.paths", "regen.files",
                     "regen.procs", "regen.objectstore", "regen.transport", "regen.logrelay", "regen.toolcalls", "regen.turns", "regen.prompts",
                     "regen.protocol", "regen.chat", "regen.markdown", "regen.secrets", "regen.engines.simulator.settings",
                     "regen.engines.simulator.text", "regen.engines.simulator.calls",
                     "regen.engines.simulator.batching")),
    ("the output's map", ("regen.layout",)),
    ("coordination and rows", ("regen.coordination", "regen.rows")),
    ("the config", ("regen.config",)),
    ("records and adapters", ("regen.config.deployment", "regen.training", "regen.results", "regen.stages", "regen.remote", "regen.manifest",
                              "regen.progress", "regen.status", "regen.alerts", "regen.engines", "regen.card",
                              "regen.servers.records", "regen.servers.gpus", "regen.servers.capacity", "regen.servers.probe", "regen.export",
                              "regen.tinymodel", "regen.audit.findings", "regen.audit.rules", "regen.quality",
                              "regen.audit.viewer", "regen.audit.report")),
    ("work", ("regen.client", "regen.dispatch", "regen.store", "regen.parts", "regen.weights", "regen.servers.lifecycle", "regen.servers.plan",
              "regen.servers.watchdog", "regen.audit.dataset", "regen.engines.simulator.app")),
    ("placement", ("regen.placement",)),
    ("stages", ("regen.generate", "regen.canary", "regen.preflight")),
    ("the seam", ("regen.pipeline",)),
    ("entry points", ("regen.cli", "regen.__main__", "regen.dags", "regen")),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the regen modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    mods = modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            deps.update(d for d in map(known, (n for n in names if n.startswith("regen"))) if d and d != module)
        graph[module] = deps
    return graph


def layer(module: str) -> int:
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the path that closes it."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    upward = [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
              for m, deps in sorted(graph.items()) for d in sorted(deps) if layer(d) > layer(m)]
    assert upward == []


def test_every_module_and_test_is_in_the_docs_module_map():
    section = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"[\w/]+\.py", section))
    files = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")]
    files += [p.relative_to(ROOT / "tests").as_posix() for p in (ROOT / "tests").rglob("*.py")
              if p.name.startswith("test_") or p.parent.name == "support"]
    missing = [f for f in files if f not in named and not f.endswith("__init__.py")]
    assert missing == []


def test_no_path_under_the_output_directory_is_built_outside_run_layout():
    """RunLayout names every path under a run's output: nothing else joins onto the output
    directory, a node's folder or the audit's report folder."""
    pattern = re.compile(r"(cfg\.output|\.output\)|layout\.root|\.root|layout\.work|layout\.alerts|"
                         r"layout\.data|node_dir\([^)]*\))\s*/\s*[\"'f]")
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
                 for p in sorted(PACKAGE.rglob("*.py")) if p.name != "layout.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
