"""Which process am I is a typed value (``runtime.job.Job``) built once at the entry, not an environment variable
read deep inside: the source is scanned with ``ast`` for reads of internal ``TRAINSCALE_*`` variables, and the job
description is checked against the environment a launcher writes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.test_layers import module_names
from trainscale.runtime import job as job_module
from trainscale.runtime.job import Job

ROOT = "trainscale"
INTERNAL = re.compile(r"TRAINSCALE_[A-Z0-9_]+")
USER_FACING = frozenset({"TRAINSCALE_DATA", "TRAINSCALE_CLUSTER_STATE"})  # the user sets these; any module may read
# The modules that may read the launcher's channel, each with why. Every other module takes the Job it is given.
ENTRY_POINTS = {
    "trainscale.runtime.job": "parses the launcher's environment into a Job (Job.from_environ, given the mapping)",
    "trainscale.commands": "every process's entry: builds its Job from os.environ once and installs it",
    "trainscale.api": "the Python entry (trainscale.fit): builds the calling process's Job for the call, as commands",
}
ENVIRON_BUILDER = "from_environ"  # building a Job from the environment: entry points only
READ_METHODS = ("get", "pop", "getenv")


def internal(name: str) -> bool:
    return bool(INTERNAL.fullmatch(name)) and name not in USER_FACING


class Constants:
    """Which names hold an internal variable's name, module by module: a module constant (``ENV_VAR = FAULT_ENV``
    too), a name imported from a module where it is one, or ``module.NAME`` through an imported module."""

    def __init__(self, trees: dict[str, ast.Module]) -> None:
        self.assigned: dict[str, dict[str, ast.expr]] = {}
        self.imported: dict[str, dict[str, tuple[str, str | None]]] = {}  # local name -> (module, name or None)
        for module, tree in trees.items():
            self.assigned[module] = {
                t.id: node.value
                for node in tree.body
                if isinstance(node, ast.Assign)
                for t in node.targets
                if isinstance(t, ast.Name)
            }
            self.imported[module] = names = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        names[alias.asname or alias.name] = (full, None) if full in trees else (base, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        names[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0],
                            None,
                        )

    def holds(self, module: str, node: ast.expr, seen: frozenset = frozenset()) -> bool:
        """Whether ``node``, in ``module``, names an internal variable."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return internal(node.value)
        if isinstance(node, ast.Name):
            return self.named(module, node.id, seen)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = self.imported.get(module, {}).get(node.value.id)
            return target is not None and target[1] is None and self.named(target[0], node.attr, seen)
        return False

    def named(self, module: str, name: str, seen: frozenset) -> bool:
        if (module, name) in seen:
            return False
        seen = seen | {(module, name)}
        value = self.assigned.get(module, {}).get(name)
        if value is not None:
            return self.holds(module, value, seen)
        target = self.imported.get(module, {}).get(name)
        return target is not None and target[1] is not None and self.named(target[0], target[1], seen)


def reads(module: str, tree: ast.Module, constants: Constants) -> list[tuple[int, str]]:
    """(line, what) for every read of an internal variable: ``X[NAME]``, ``X.get(NAME)``, ``X.pop(NAME)``,
    ``os.getenv(NAME)`` and ``NAME in X``. Writes (``env[NAME] = ...``, ``{NAME: ...}`` for a child's environment)
    are the launcher's channel and pass."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and _called(node) in READ_METHODS:
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            key = node.left
        if key is not None and constants.holds(module, key):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def builders(tree: ast.Module) -> list[int]:
    """Lines that build a Job from an environment (``Job.from_environ(...)``)."""
    return sorted(
        node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and _called(node) == ENVIRON_BUILDER
    )


def violations(root: Path, entry_points: dict[str, str]) -> list[str]:
    """Every module outside ``entry_points`` that reads an internal variable or builds a Job from an environment,
    one line each."""
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in module_names(root).items()}
    constants = Constants(trees)
    errors = []
    for name, tree in trees.items():
        if name in entry_points:
            continue
        errors += [
            f"{name} line {line} reads an internal variable: {text}; take it from the Job the entry builds "
            "(trainscale.runtime.job)"
            for line, text in reads(name, tree, constants)
        ]
        errors += [
            f"{name} line {line} builds a Job from the environment: only the entry points do "
            f"({', '.join(entry_points)})"
            for line in builders(tree)
        ]
    return errors


def test_no_module_below_the_entry_reads_an_internal_variable() -> None:
    found = violations(Path(__file__).resolve().parents[2] / "src" / ROOT, ENTRY_POINTS)
    assert not found, f"{len(found)} read(s) of the launcher's environment below the entry:\n" + "\n".join(found)


def test_the_entry_points_exist_and_build_the_job() -> None:
    root = Path(__file__).resolve().parents[2] / "src" / ROOT
    modules = module_names(root)
    assert set(ENTRY_POINTS) <= set(modules)
    assert builders(ast.parse(modules["trainscale.commands"].read_text()))  # it does build the job


def fake_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / ROOT
    job = 'REPLICA_ENV = "TRAINSCALE_FT_REPLICA"\nSLOW = REPLICA_ENV\n'
    for rel, text in {"runtime/job.py": job, **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return root


FAKE_ENTRIES = {"trainscale.runtime.job": "the parser"}


@pytest.mark.parametrize(
    "text, line",
    [
        ("import os\nx = os.environ.get('TRAINSCALE_FT_REPLICA')\n", 2),  # a literal
        (
            "import os\nfrom trainscale.runtime.job import REPLICA_ENV\ndef f():\n    return os.environ[REPLICA_ENV]\n",
            4,
        ),
        ("import os\nfrom trainscale.runtime import job\nx = os.getenv(job.REPLICA_ENV)\n", 3),  # module.NAME
        ("import os\nfrom trainscale.runtime.job import SLOW\nx = SLOW in os.environ\n", 3),  # through an alias
        ("import os\nMINE = 'TRAINSCALE_NEW_THING'\nx = os.environ.get(MINE, '')\n", 3),  # a local constant
        ("from os import environ\ndef f(env=environ):\n    return env.get('TRAINSCALE_X')\n", 3),  # any mapping
    ],
)
def test_a_reintroduced_read_is_reported(tmp_path: Path, text: str, line: int) -> None:
    (error,) = violations(fake_tree(tmp_path, {"modes/deep.py": text}), FAKE_ENTRIES)
    assert error.startswith(f"trainscale.modes.deep line {line} reads an internal variable:"), error


def test_a_job_built_below_the_entry_is_reported(tmp_path: Path) -> None:
    text = "import os\nfrom trainscale.runtime.job import Job\njob = Job.from_environ(os.environ)\n"
    assert violations(fake_tree(tmp_path, {"train/deep.py": text}), FAKE_ENTRIES) == [
        "trainscale.train.deep line 3 builds a Job from the environment: only the entry points do "
        "(trainscale.runtime.job)"
    ]


def test_writes_user_variables_and_torch_variables_pass(tmp_path: Path) -> None:
    text = (
        "import os\nfrom trainscale.runtime.job import REPLICA_ENV\n"
        "env = {**os.environ, REPLICA_ENV: '1'}\nos.environ[REPLICA_ENV] = '2'\nenv[REPLICA_ENV] = '3'\n"
        "data = os.environ.get('TRAINSCALE_DATA')\nrank = os.environ.get('RANK', '0')\n"
    )
    assert violations(fake_tree(tmp_path, {"app/launcher.py": text}), FAKE_ENTRIES) == []


def test_an_entry_point_may_read(tmp_path: Path) -> None:
    root = fake_tree(tmp_path, {"cli.py": "import os\nx = os.environ.get('TRAINSCALE_FT_REPLICA')\n"})
    assert violations(root, {**FAKE_ENTRIES, "trainscale.cli": "an entry"}) == []


# ------------------------------------------------------------------------------ the job description itself


def test_a_local_process_by_default() -> None:
    job = Job.from_environ({})
    assert job == Job() and job.role == "local" and not job.by_trainscale and job.cluster is None
    assert job.folder_holders == () and job.writes_folder_first


def test_a_fault_tolerant_replica_from_its_launchers_environment(tmp_path: Path) -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
        job_module.REPLICA_ENV: "3",
        job_module.REPLICAS_ENV: "4",
        job_module.OWNER_ENV: "100",
        job_module.LAUNCHER_PID_ENV: "101",
        job_module.EVENTS_ENV: str(tmp_path / "ft-events.jsonl"),
        job_module.BARRIER_ENV: "127.0.0.1:1234",
        job_module.NODE_ENV: "2",
        job_module.CLUSTER_ENV: '{"name": "c", "hosts": 3}',
    }
    job = Job.from_environ(env)
    assert (job.role, job.replica, job.replicas, job.restarts, job.node) == ("replica", 3, 4, 2, 2)
    assert job.master == ("127.0.0.1", 29500) and job.barrier == "127.0.0.1:1234"
    assert job.fault_log == tmp_path / "ft-events.jsonl" and job.cluster_name == "c"
    assert job.folder_holders == (101, 100) and not job.writes_folder_first  # replica 3, and restarted
    agent = Job.from_environ({job_module.REPLICA_ENV: "0"})
    assert agent.role == "replica agent" and agent.writes_folder_first


def test_every_internal_variable_the_launchers_write_is_read_into_the_job() -> None:
    """The channel's vocabulary is runtime.job's: each name it defines reaches a field (written by a launcher,
    read here), so no second reader is needed anywhere."""
    names = {value for key, value in vars(job_module).items() if key.endswith("_ENV") and isinstance(value, str)}
    values = {name: "7" for name in names} | {job_module.CLUSTER_ENV: '{"name": "n"}'}
    assert Job.from_environ(values) != Job()
    for name in names:
        assert Job.from_environ({name: values[name]}) != Job() or name == job_module.CLUSTER_ENV, name
    assert Job.from_environ({job_module.CLUSTER_ENV: '{"name": "n"}'}).cluster == {"name": "n"}


def test_the_installed_job_is_answered_until_replaced() -> None:
    before = job_module.this_job()
    with job_module.installed(Job(replica=1)) as job:
        assert job_module.this_job() is job
    assert job_module.this_job() is before
