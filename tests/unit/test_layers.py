"""Every import inside trainscale must point down a layer (see docs/architecture.md, "Where things live").

``LAYERS`` stacks the units (top-level modules and packages), lowest first. A module may import its own unit and
lower layers, never a higher layer or a sibling unit, and never in a cycle. Imports are read with ``ast`` (also
inside functions and ``if TYPE_CHECKING:`` blocks, since a type checker follows those too), so a wrong one fails
here, naming importer, line, target and rule, instead of surfacing later as a circular-import error at run time.
A name that starts with an underscore is private to its unit: no other unit imports it.

The scripts in ``benchmarks/`` are a layer above the entry points: they may import any unit and any module directly
inside a unit (``trainscale.train.loop``), but a sub-package (``trainscale.modes.ps``) only through what its
``__init__`` exports, never one of its modules (``trainscale.modes.ps.client``), and never a name or module that
starts with an underscore.

``cluster`` (emulated clusters: the `cluster` command, time dilation, the wire counter, the bench's cluster keys and
the seam a run on a cluster installs) sits below ``app``: the app's composition root installs its seam and its
pre-flight checks the cluster; the `train --cluster` launcher, which runs on the app's pre-flight and node commands,
is ``app.cluster_launch``. Its runtime floor (namespaces, links, CPU groups, probes) is ``runtime.cluster`` and
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
    Layer(
        "base",
        ("errors", "stops", "log", "registry", "config", "recipes", "io", "record", "results", "console"),
        loose=True,
    ),
    Layer("runtime", ("runtime",)),
    Layer("data+models", ("data", "models")),
    Layer("compression+train", ("compression", "train")),
    Layer("modes", ("modes",)),
    Layer("plan", ("plan",)),
    Layer("cluster", ("cluster",)),
    Layer("app", ("app",)),
    Layer("bench", ("bench",)),
    Layer("report", ("report",)),
    Layer("entry points", ("cli", "commands", "__main__", "api"), loose=True),
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


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


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
        anchor = parts[: max(0, len(parts) - node.level + 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [
        _resolve(f"{base}.{alias.name}", modules) if f"{base}.{alias.name}" in modules else _resolve(base, modules)
        for alias in node.names
    ]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The trainscale modules that module ``name`` (file ``path``) imports, with their lines."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {
        Import(name, node.lineno, target)
        for node in _import_nodes(tree)
        for target in _targets(node, package, modules)
        if target and target != name and target.split(".")[0] == ROOT
    }
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
    errors += [error for name, path in modules.items() for error in private_imports(name, path, modules)]
    for component in _cycles(edges):
        inside = "".join(f"\n    {imp}" for imp in edges if {imp.importer, imp.target} <= component)
        errors.append(f"import cycle between {', '.join(sorted(component))}:{inside}")
    return errors


def private_imports(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Names starting with an underscore that module ``name`` takes from another unit (a private helper crossing
    packages: give it a public name in a home both may import)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            for alias, target in zip(node.names, _targets(node, package, modules)):
                if alias.name.startswith("_") and target and _unit(target) != _unit(name):
                    found.append(
                        f"{Import(name, node.lineno, target)}: takes the private name {alias.name} from another unit"
                    )
    return found


def _benchmark_error(imp: Import, names: list[str]) -> str | None:
    where, parts = imp.importer, imp.target.split(".")
    private = [part for part in parts if part.startswith("_")] + [name for name in names if name.startswith("_")]
    if private:
        return f"{where} line {imp.line} imports {imp.target}: the private name {private[0]} is not for benchmarks"
    if len(parts) > 3:
        package = ".".join(parts[:3])
        return (
            f"{where} line {imp.line} imports {imp.target}: reaches into the sub-package {package}; "
            f"import what {package} exports (add it to its __init__ if it is public)"
        )
    return None


def benchmark_violations(folder: Path, root: Path) -> list[str]:
    """Every import in the scripts under ``folder`` that breaks the benchmark rule against the package ``root``."""
    modules = module_names(root)
    errors: list[str] = []
    for path in sorted(folder.rglob("*.py")):
        where = path.relative_to(folder.parent).as_posix()
        for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            for target in dict.fromkeys(_targets(node, "", modules)):
                error = (
                    _benchmark_error(Import(where, node.lineno, target), names)
                    if (target and target.split(".")[0] == ROOT)
                    else None
                )
                errors += [error] if error else []
    return errors


def test_trainscale_imports_point_down() -> None:
    found = violations(Path(__file__).resolve().parents[2] / "src" / "trainscale", LAYERS)
    assert not found, f"{len(found)} import(s) break the layers:\n" + "\n".join(found)


def test_benchmarks_use_public_modules() -> None:
    repo = Path(__file__).resolve().parents[2]
    assert any((repo / "benchmarks").glob("*.py")), "no benchmark scripts found: has benchmarks/ moved?"
    found = benchmark_violations(repo / "benchmarks", repo / "src" / ROOT)
    assert not found, f"{len(found)} benchmark import(s) reach past the public modules:\n" + "\n".join(found)


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


@pytest.mark.parametrize(
    "text, line",
    [
        ("import os\nfrom trainscale.app import main\n", 2),  # module level
        ("def f():\n    import trainscale.app.main.run\n", 2),  # inside a function, longest module prefix
        ("class C:\n    from ..app.main import run\n", 2),  # relative, inside a class
    ],
)
def test_upward_import_is_reported(tmp_path: Path, text: str, line: int) -> None:
    assert violations(fake_tree(tmp_path, {"core/a.py": text}), FAKE_LAYERS) == [
        f"trainscale.core.a line {line} imports trainscale.app.main: points up: layer core imports layer app"
    ]


def test_type_checking_upward_import_is_reported(tmp_path: Path) -> None:
    text = (
        "import typing\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainscale.app import main\n"
        "if typing.TYPE_CHECKING:\n    import trainscale.app.main\n"
    )
    assert violations(fake_tree(tmp_path, {"core/a.py": text}), FAKE_LAYERS) == [
        f"trainscale.core.a line {line} imports trainscale.app.main: points up: layer core imports layer app"
        for line in (4, 6)
    ]


def test_type_checking_cycle_is_reported(tmp_path: Path) -> None:
    a_text = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainscale.core.b import B\n"
    root = fake_tree(tmp_path, {"core/a.py": a_text, "core/b.py": "from trainscale.core.a import A\n"})
    (error,) = violations(root, FAKE_LAYERS)
    assert error.startswith("import cycle between trainscale.core.a, trainscale.core.b:")


def _fake_benchmarks(tmp_path: Path, text: str) -> list[str]:
    root = fake_tree(
        tmp_path, {"core/deep/__init__.py": "from .inner import f\n", "core/deep/inner.py": "", "core/a.py": ""}
    )
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "speed.py").write_text(text)
    return benchmark_violations(tmp_path / "benchmarks", root)


@pytest.mark.parametrize(
    "text, error",
    [
        (
            "import os\nfrom trainscale.core.deep.inner import f\n",
            "line 2 imports trainscale.core.deep.inner: reaches "
            "into the sub-package trainscale.core.deep; import what trainscale.core.deep exports",
        ),
        ("def main():\n    import trainscale.core.deep.inner\n", "line 2 imports trainscale.core.deep.inner: reaches"),
        ("from trainscale.core.deep import inner\n", "line 1 imports trainscale.core.deep.inner: reaches"),
        ("from trainscale.core.a import _helper\n", "line 1 imports trainscale.core.a: the private name _helper"),
    ],
)
def test_benchmark_reaching_into_internals_is_reported(tmp_path: Path, text: str, error: str) -> None:
    (found,) = _fake_benchmarks(tmp_path, text)
    assert found.startswith(f"benchmarks/speed.py {error}")


def test_benchmark_public_imports_pass(tmp_path: Path) -> None:
    text = (
        "import trainscale\nfrom trainscale.core import a\nfrom trainscale.core.deep import f\n"
        "import trainscale.core.a\nfrom trainscale.errors import E\nimport numpy\n"
    )
    assert _fake_benchmarks(tmp_path, text) == []


def test_sideways_import_is_reported(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, {"core/a.py": "from trainscale.data.b import x\n", "data/b.py": ""})
    (error,) = violations(root, FAKE_LAYERS)
    assert error.startswith("trainscale.core.a line 1 imports trainscale.data.b: sideways")


def test_private_name_from_another_unit_is_reported(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        {
            "core/a.py": "from trainscale.core.b import _ok\n",
            "core/b.py": "",
            "app/main.py": "def f():\n    from ..core.b import _helper\n",
        },
    )
    assert violations(root, FAKE_LAYERS) == [
        "trainscale.app.main line 2 imports trainscale.core.b: takes the private name _helper from another unit"
    ]


def test_cycle_is_reported(tmp_path: Path) -> None:
    b_text = "def f():\n    from trainscale.core import a\n"
    root = fake_tree(tmp_path, {"core/a.py": "from . import b\n", "core/b.py": b_text})
    assert violations(root, FAKE_LAYERS) == [
        "import cycle between trainscale.core.a, trainscale.core.b:\n    trainscale.core.a line 1 imports "
        "trainscale.core.b\n    trainscale.core.b line 2 imports trainscale.core.a"
    ]


def test_clean_tree_has_no_violations(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        {
            "util.py": "from .errors import E\n",
            "errors.py": "class E(Exception): pass\n",
            "core/a.py": "import trainscale.util\nfrom trainscale.core import b\nfrom . import c\n",
            "core/b.py": "from trainscale.errors import E\n",
            "core/c.py": "from trainscale.core import thing\n",
            "app/main.py": "def run():\n    from trainscale.core.a import f\n    from ..errors import E\n",
        },
    )
    assert violations(root, FAKE_LAYERS) == []


def test_module_in_no_layer_is_reported(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, {"extra/thing.py": "", "loose.py": ""})
    assert violations(root, FAKE_LAYERS) == [NO_LAYER.format("trainscale.extra"), NO_LAYER.format("trainscale.loose")]
