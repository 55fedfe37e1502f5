"""Any config or grid file, however wrong, is accepted or refused with one line of trainscale's own errors,
and checking it writes nothing: load_toml + build_config + the dry run, and the planning of
`trainscale bench --dry-run`, over generated files (mostly real keys, wrong types, odd values and paths)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trainscale.app.config import FIELDS, TYPES, build_config, load_toml
from trainscale.app.dryrun import dry_run
from trainscale.bench.cli import print_plan
from trainscale.bench.grid import ROW_KEYS, SCALE_KEYS, TOP_KEYS
from trainscale.bench.runner import BenchOptions, plan
from trainscale.errors import TrainscaleError
from trainscale.modes import list_modes

REAL_DATA = os.environ.get("TRAINSCALE_DATA", "")
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Raw(str):
    """TOML text written as is: an integer literal too long for Python's int-to-text conversion."""


PATHS = [
    "../x",
    "/etc",
    "/",
    "/etc/passwd",
    "/dev/null",
    "~",
    "..",
    ".",
    "",
    "runs",
    "a" * 300,
    "x\ny",
    "\x00",
    "dir/../../up",
    "/proc/self",
    "ünïcødé/ラン",
    *([REAL_DATA] if REAL_DATA else []),
]
NAMES = {
    "model": ["mlp", "resnet9", "nosuch"],
    "dataset": ["synthetic", "cifar10", "cifar100", "imagefolder"],
    "mode": ["auto", *list_modes()],
    "device": ["cpu", "auto", "cuda", "cuda:3", "tpu"],
    "precision": ["fp32", "bf16", "fp16", "auto"],
    "schedule": ["onecycle", "step", "cosine", "constant"],
    "nonfinite": ["stop", "skip"],
    "backend": ["auto", "gloo", "nccl"],
    "compress": ["none", "topk", "qsgd"],
}

printable = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp")), max_size=12)
texts = st.one_of(printable, printable, printable, st.text(max_size=12))
scalars = st.one_of(
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.booleans(),
    texts,
    st.sampled_from(PATHS),
    st.just(Raw("1" * 5000)),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=5,
)


def typed_value(name: str) -> st.SearchStrategy:
    """A value of the field's own type, often a plausible one, so checks past the type check run too."""
    hint = str(TYPES[name])
    if name in NAMES:
        return st.sampled_from(NAMES[name])
    if "bool" in hint:
        return st.booleans()
    if "list" in hint:
        return st.lists(st.integers(-1, 100), max_size=3)
    if "int" in hint:
        return st.one_of(st.integers(0, 4), st.integers(-(2**65), 2**65), st.sampled_from([32, 64, 256, 512]))
    if "float" in hint:
        return st.one_of(st.floats(), st.floats(0, 1))
    return st.one_of(st.sampled_from(PATHS), texts)


def setting(name: str) -> st.SearchStrategy:
    return st.tuples(
        st.sampled_from([name, name.replace("_", "-")]),
        st.one_of(typed_value(name), typed_value(name), typed_value(name), anything),
    )


# A small run that passes every check, so the mutations drawn over it reach the dry run's own checks.
RUNNABLE = {
    "model": "mlp",
    "dataset": "synthetic",
    "train_subset": 256,
    "test_subset": 64,
    "batch_size": 64,
    "device": "cpu",
}


def settings_table(max_size: int = 8) -> st.SearchStrategy:
    real = st.sampled_from(sorted(FIELDS)).flatmap(setting)
    unknown = st.tuples(texts, anything)
    drawn = st.lists(st.one_of(real, real, real, real, real, real, unknown), max_size=max_size).map(dict)
    near = st.lists(real, max_size=3).map(lambda items: {**RUNNABLE, **dict(items)})
    return st.one_of(drawn, near)


# ------------------------------------------------------------------------------ writing TOML


def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, Raw):
        return str.__str__(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if value != value else {float("inf"): "inf", float("-inf"): "-inf"}.get(value, repr(value))
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_table(table: dict[str, Any]) -> str:
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in table.items())


# ------------------------------------------------------------------------------ the sandbox


@contextlib.contextmanager
def sandbox() -> Iterator[Path]:
    """cwd = <tmp>/outer/inner (so ``../x`` stays inside <tmp>/outer), $TRAINSCALE_DATA an empty folder."""
    old_cwd, old_data = os.getcwd(), os.environ.get("TRAINSCALE_DATA")
    with tempfile.TemporaryDirectory() as tmp:
        inner = Path(tmp, "outer", "inner")
        (inner / "data").mkdir(parents=True)
        os.chdir(inner)
        os.environ["TRAINSCALE_DATA"] = str(inner / "data")
        try:
            yield inner
        finally:
            os.chdir(old_cwd)
            os.environ.pop("TRAINSCALE_DATA") if old_data is None else os.environ.update(TRAINSCALE_DATA=old_data)


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``roots`` with its size and modification time."""
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            info = path.lstat()
            found[str(path)] = (info.st_size, info.st_mtime_ns)
    return found


def watched(inner: Path) -> list[Path]:
    return [inner.parent] + ([Path(REAL_DATA)] if REAL_DATA else [])


def assert_one_line(exc: TrainscaleError) -> None:
    message = str(exc)
    assert message.strip() and len(message.splitlines()) == 1, repr(message)


# ------------------------------------------------------------------------------ config files


@PROPS
@given(table=settings_table())
@example(table={"lr": 2**1100})  # float() of it overflows
@example(table={"lr": Raw("1" * 5000)})  # tomllib's int() refuses it with a ValueError
@example(table={"x\ny": 1})  # a key that would break the message over two lines
@example(table={**RUNNABLE, "rdzv_id": "a\nb"})
@example(table={**RUNNABLE, "out": "a" * 300})  # the file system refuses the name (OSError)
@example(table={**RUNNABLE, "dataset": "cifar10", "data_dir": "a" * 300})
@example(table={**RUNNABLE, "seed": 2**64})  # torch.manual_seed would overflow
def test_any_config_file_is_loaded_or_refused_in_one_line_and_nothing_is_written(table):
    with sandbox() as inner:
        path = inner / "config.toml"
        path.write_text(toml_table(table))
        before = snapshot(*watched(inner))
        try:
            dry_run(build_config(load_toml(path)))
        except TrainscaleError as exc:
            assert_one_line(exc)
        assert snapshot(*watched(inner)) == before


# ------------------------------------------------------------------------------ grid files

axis = st.sampled_from(sorted(FIELDS)).flatmap(
    lambda name: st.tuples(
        st.just(name), st.one_of(st.lists(st.one_of(typed_value(name), anything), max_size=2), anything)
    )
)
axes = st.lists(axis, max_size=2).map(dict)
row = st.fixed_dictionaries(
    {},
    optional={
        "short_name": st.one_of(texts, anything),
        "axes": axes,
        "scale": st.dictionaries(texts, settings_table(2), max_size=1),
    },
).flatmap(lambda r: settings_table(3).map(lambda s: {**s, **r}))
scale = st.fixed_dictionaries(
    {},
    optional={
        "repeats": st.one_of(st.integers(0, 2), anything),
        "axes": axes,
        "rows": st.lists(texts, max_size=2),
        "description": anything,
    },
).flatmap(lambda t: settings_table(3).map(lambda s: {**s, **t}))
grids = st.fixed_dictionaries(
    {"name": st.one_of(st.just("g"), st.just("g"), anything), "base": settings_table()},
    optional={
        "description": anything,
        "source": texts,
        "repeats": st.one_of(st.integers(0, 3), anything),
        "axes": axes,
        "rows": st.lists(row, max_size=2),
        "scale": st.dictionaries(st.sampled_from(["quick", "full", "x"]), scale, max_size=2),
    },
).flatmap(
    lambda grid: st.one_of(
        st.just(grid), st.dictionaries(texts, anything, max_size=1).map(lambda extra: {**grid, **extra})
    )
)


def grid_text(grid: dict[str, Any]) -> str:
    """Top-level keys, then [base], [axes], [scale.*] and [[rows]] as tables (inline tables elsewhere)."""
    tables = {k: v for k, v in grid.items() if k in TOP_KEYS and isinstance(v, dict)}
    rows = grid.get("rows") if isinstance(grid.get("rows"), list) else []
    text = toml_table({k: v for k, v in grid.items() if k not in tables and k != "rows"})
    for name, table in tables.items():
        text += f"[{name}]\n" + toml_table(table)
    for item in rows:
        text += "[[rows]]\n" + toml_table(item)
    return text


@PROPS
@given(grid=grids, scale_name=st.sampled_from(["quick", "full", "x"]), allow_ssh=st.booleans())
@example(grid={"name": "g", "base": {"x\ny": 1}}, scale_name="quick", allow_ssh=False)
@example(grid={"name": "g\nh", "base": RUNNABLE}, scale_name="quick", allow_ssh=False)
@example(grid={"name": "g", "base": {"lr": Raw("1" * 5000)}}, scale_name="quick", allow_ssh=False)
@example(grid={"name": "g", "base": {**RUNNABLE, "lr": 2**1100}}, scale_name="quick", allow_ssh=False)
@example(grid={"name": "g", "repeats": 10**9, "base": RUNNABLE}, scale_name="quick", allow_ssh=False)
def test_any_grid_is_planned_or_refused_in_one_line_and_nothing_is_written(grid, scale_name, allow_ssh):
    assert set(ROW_KEYS) <= {"short_name", "axes", "scale"} and "rows" in SCALE_KEYS  # the shapes drawn here
    with sandbox() as inner:
        path = inner / "grid.toml"
        path.write_text(grid_text(grid))
        before = snapshot(*watched(inner))
        options = BenchOptions(grid=path, out=inner / "out", scale=scale_name, allow_ssh=allow_ssh)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                print_plan(options, *plan(options))
        except TrainscaleError as exc:
            assert_one_line(exc)
        assert snapshot(*watched(inner)) == before


# ------------------------------------------------------------------------------ the command


def test_train_dry_run_prints_the_resolved_config_and_writes_nothing(main_cli, tmp_path):
    flags = (
        "train",
        "--dry-run",
        "--model",
        "mlp",
        "--dataset",
        "synthetic",
        "--train-subset",
        "256",
        "--test-subset",
        "64",
        "--batch-size",
        "64",
        "--workers",
        "2",
        "--out",
        "run",
    )
    proc = main_cli(*flags, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert (shown["mode"], shown["workers"], shown["dry_run"]) == ("sync", 2, True)
    assert shown["resolved"]["batch_per_worker"] == 32 and shown["resolved"]["out"] == "run"
    assert list(tmp_path.iterdir()) == []
    refused = main_cli(*flags, "--batch-size", "512", cwd=tmp_path)
    assert refused.returncode == 2 and "batch size 256 per worker is larger than the 128" in refused.stderr
    assert list(tmp_path.iterdir()) == []
