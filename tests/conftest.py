"""Shared fixtures. ``cifar10_dir``: the real CIFAR-10 that TRAINSCALE_DATA points to; ``main_cli``: the CLI in
this process; ``short_temp``: a TMPDIR for processes a test may kill. Tests marked ``gpu`` are skipped, with the
reason, where torch sees no CUDA device. Under pytest-xdist a test marked ``alone`` runs with no other test beside
it (``pytest_runtest_protocol``)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest


@pytest.fixture(scope="session")
def cifar10_dir() -> Path:
    """Path of the real CIFAR-10 (a batches folder or its parent) from $TRAINSCALE_DATA.

    Unset: the test is skipped, except under CI=true where a missing data set is a failure.
    """
    value = os.environ.get("TRAINSCALE_DATA", "")
    if not value:
        message = (
            "TRAINSCALE_DATA is not set: point it at the real CIFAR-10 (e.g. "
            "../shared/data/cifar-10-batches-bin) to run the real-data tests"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: real-data tests must run in CI)")
        pytest.skip(message)
    path = Path(value).expanduser()
    if not path.exists():
        pytest.fail(f"TRAINSCALE_DATA={value} does not exist")
    return path


@pytest.fixture
def short_temp() -> Iterator[Path]:
    """A TMPDIR for the processes a test starts and may kill by SIGKILL (which leaves their temporary folders):
    removed afterwards, with a path short enough for the Unix sockets made in it (pytest's tmp_path is not)."""
    folder = Path(tempfile.mkdtemp(prefix="tsp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def main_cli(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Callable[..., CompletedProcess]:
    """``tests.integration.cli.run_cli`` in this process: the entry point's ``main`` itself, without the seconds of
    interpreter start-up and imports a subprocess costs. For input refused before any worker starts; argparse's
    exit is the status, log lines go to this call's stderr."""

    def run(*args: object, cwd: Path | None = None, env: dict[str, str] | None = None) -> CompletedProcess:
        from trainscale.cli import main

        argv = [str(a) for a in args]
        with monkeypatch.context() as patch:
            if cwd is not None:
                patch.chdir(cwd)
            for key, value in (env or {}).items():
                patch.setenv(key, value)
            patch.setattr(logging.getLogger("trainscale"), "handlers", [])
            capsys.readouterr()
            try:
                status = main(argv)
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            out, err = capsys.readouterr()
        return CompletedProcess(["trainscale", *argv], status, out, err)

    return run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


# Two lock objects every pytest process of this checkout can open, and that nothing else locks: the gate a test
# passes on its way in, and the machine it then shares or holds.
GATE, MACHINE = Path(__file__), Path(__file__).parent


@contextlib.contextmanager
def _flocked(path: Path, operation: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        os.close(fd)  # closing drops the lock


@contextlib.contextmanager
def machine(alone: bool, gate: Path = GATE, shared: Path = MACHINE) -> Iterator[None]:
    """The machine shared with the tests beside this one, or held by this one alone: a readers-writer lock over
    two flocks. A test passes the gate while it waits for its share or its hold, so a waiting ``alone`` test keeps
    the others from coming in after it and is not starved by a stream of them."""
    with contextlib.ExitStack() as held:
        with _flocked(gate, fcntl.LOCK_EX):
            held.enter_context(_flocked(shared, fcntl.LOCK_EX if alone else fcntl.LOCK_SH))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Under pytest-xdist (``make test`` runs the multi-process tests two at a time), a test marked ``alone`` runs
    with no other beside it, its fixtures' setup and teardown included: its assertions time faults, heartbeats or
    links against the wall clock, which a neighbour's load would stretch. Run without xdist, tests are one at a
    time anyway."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    with machine(item.get_closest_marker("alone") is not None):
        yield
