"""Every import inside trainscale must point down a layer (see README "Where things live").

``LAYERS`` stacks the units (top-level modules and packages), lowest first. A module may import its own unit and
lower layers, never a higher layer or a sibling unit, and never in a cycle. Imports are read with ``ast`` (also
inside functions; ``if TYPE_CHECKING:`` blocks skipped), so a wrong one fails here, naming importer, line, target
and rule, instead of surfacing later as a circular-import error at run time.

``cluster`` (emulated clusters: the `cluster` command, the `train --cluster` launcher, time dilation, the wire
counter and the seam a run on a cluster installs) stands beside ``app`` in a loose layer: its launcher runs on the
app's pre-flight and launcher, and the app's composition root installs its seam, so each imports the other (module
cycles still fail). Its runtime floor (namespaces, links, CPU groups, probes) is ``runtime.cluster`` and
``runtime.netprobe``: only the runtime layer creates or destroys namespaces, and fault injection and the planner,
below ``app``, use it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = "trainscale"
NO_LAYER = "{} is in no layer: add it to LAYERS in tests/unit/test_layers.py"


@dataclass(frozen=True)
class Layer:
    name: str
    units: tuple[str, ...]
    loose: bool = False  # its units may import each other (cycles are still errors)


LAYERS: tuple[Layer, ...] = (
    Layer("base", ("errors", "log", "registry", "config", "recipes", "io", "results", "console"), loose=True),
    Layer("runtime", ("runtime",)),
    Layer("data+models", ("data", "models")),
    Layer("compression+train", ("compression", "train")),
    Layer("modes", ("modes",)),
    Layer("plan", ("plan",)),
    Layer("app", ("app", "cluster"), loose=True),
    Layer("bench", ("bench",)),
    Layer("report", ("report",)),
    Layer("entry points", ("cli", "commands", "__main__"), loose=True),
)


@dataclass(frozen=True)
class Import:
    importer: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.importer} line {self.line} imports {self.target}"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name of every module under the package folder ``root`` (``a/__init__.py`` is ``a``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    children = node.orelse if isinstance(node, ast.If) and _is_type_checking(node.test) else (
        list(ast.iter_child_nodes(node)))
    return [found for child in children for found in _import_nodes(child)]


def _resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``dotted`` that is a known module, or None."""
    parts = dotted.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str | None]:
    if isinstance(node, ast.Import):
        return [_resolve(alias.name, modules) for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        anchor = parts[:max(0, len(parts) - node.level + 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [_resolve(f"{base}.{alias.name}", modules) if f"{base}.{alias.name}" in modules
            else _resolve(base, modules) for alias in node.names]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The trainscale modules that module ``name`` (file ``path``) imports, with their lines."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {Import(name, node.lineno, target) for node in _import_nodes(tree)
             for target in _targets(node, package, modules)
             if target and target != name and target.split(".")[0] == ROOT}
    return sorted(found, key=lambda imp: (imp.line, imp.target))


def _unit(name: str) -> str | None:
    return name.split(".")[1] if "." in name else None


def _layer_error(imp: Import, where: dict[str, int], layers: tuple[Layer, ...]) -> str | None:
    if _unit(imp.importer) is None:
        return f"{imp}: the root package {ROOT} must import nothing from {ROOT}"
    if _unit(imp.target) is None:
        return None if imp.importer == f"{ROOT}.__main__" else f"{imp}: only {ROOT}.__main__ may import the root {ROOT}"
    mine, theirs = _unit(imp.importer), _unit(imp.target)
    if mine == theirs or mine not in where or theirs not in where:
        return None
    i, j = where[mine], where[theirs]
    if j > i:
        return f"{imp}: points up: layer {layers[i].name} imports layer {layers[j].name}"
    if j == i and not layers[i].loose:
        return f"{imp}: sideways between units of the same layer {layers[i].name} ({mine} -> {theirs})"
    return None


def _cycles(edges: list[Import]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in edges:
        graph.setdefault(imp.importer, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def violations(root: Path, layers: tuple[Layer, ...]) -> list[str]:
    """Every broken layering rule in the package folder ``root``, one readable line each."""
    modules = module_names(root)
    where = {unit: i for i, layer in enumerate(layers) for unit in layer.units}
    unplaced = sorted({f"{ROOT}.{unit}" for unit in map(_unit, modules) if unit and unit not in where})
    edges = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    errors = [NO_LAYER.format(name) for name in unplaced]
    errors += [error for imp in edges if (error := _layer_error(imp, where, layers))]
    for component in _cycles(edges):
        inside = "".join(f"\n    {imp}" for imp in edges if {imp.importer, imp.target} <= component)
        errors.append(f"import cycle between {', '.join(sorted(component))}:{inside}")
    return errors


def test_trainscale_imports_point_down() -> None:
    found = violations(Path(__file__).resolve().parents[2] / "src" / "trainscale", LAYERS)
    assert not found, f"{len(found)} import(s) break the layers:\n" + "\n".join(found)


FAKE_LAYERS = (Layer("base", ("errors", "util"), loose=True), Layer("core", ("core", "data")), Layer("app", ("app",)))


def fake_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A fake trainscale package under tmp_path holding ``files`` (and empty ``__init__.py`` files)."""
    root = tmp_path / ROOT
    for rel, text in {"errors.py": "", "app/main.py": "", "core/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return root


@pytest.mark.parametrize("text, line", [
    ("import os\nfrom trainscale.app import main\n", 2),  # module level
    ("def f():\n    import trainscale.app.main.run\n", 2),  # inside a function, longest module prefix
    ("class C:\n    from ..app.main import run\n", 2),  # relative, inside a class
])
def test_upward_import_is_reported(tmp_path: Path, text: str, line: int) -> None:
    assert violations(fake_tree(tmp_path, {"core/a.py": text}), FAKE_LAYERS) == [
        f"trainscale.core.a line {line} imports trainscale.app.main: points up: layer core imports layer app"]


def test_type_checking_imports_are_ignored(tmp_path: Path) -> None:
    text = ("import typing\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainscale.app import main\n"
            "if typing.TYPE_CHECKING:\n    import trainscale.app.main\n")
    assert violations(fake_tree(tmp_path, {"core/a.py": text}), FAKE_LAYERS) == []


def test_sideways_import_is_reported(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, {"core/a.py": "from trainscale.data.b import x\n", "data/b.py": ""})
    (error,) = violations(root, FAKE_LAYERS)
    assert error.startswith("trainscale.core.a line 1 imports trainscale.data.b: sideways")


def test_cycle_is_reported(tmp_path: Path) -> None:
    b_text = "def f():\n    from trainscale.core import a\n"
    root = fake_tree(tmp_path, {"core/a.py": "from . import b\n", "core/b.py": b_text})
    assert violations(root, FAKE_LAYERS) == [
        "import cycle between trainscale.core.a, trainscale.core.b:\n    trainscale.core.a line 1 imports "
        "trainscale.core.b\n    trainscale.core.b line 2 imports trainscale.core.a"]


def test_clean_tree_has_no_violations(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, {
        "util.py": "from .errors import E\n", "errors.py": "class E(Exception): pass\n",
        "core/a.py": "import trainscale.util\nfrom trainscale.core import b\nfrom . import c\n",
        "core/b.py": "from trainscale.errors import E\n", "core/c.py": "from trainscale.core import thing\n",
        "app/main.py": "def run():\n    from trainscale.core.a import f\n    from ..errors import E\n"})
    assert violations(root, FAKE_LAYERS) == []


def test_module_in_no_layer_is_reported(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, {"extra/thing.py": "", "loose.py": ""})
    assert violations(root, FAKE_LAYERS) == [NO_LAYER.format("trainscale.extra"), NO_LAYER.format("trainscale.loose")]
