"""A stop (Ctrl-C, SIGTERM) that comes while a launcher starts a child must stop that child too. Before, a stop
raised inside ``subprocess.Popen`` left the child unrecorded: its launcher stopped every other process and ended,
and the child lived on until its parent-death signal ended it moments later (a bench's Ctrl-C test once saw it).
Here the stop is raised the moment the child exists, the worst instant."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_bench_runner import fake_python, options  # the runner's stand-in for `trainscale train`
from trainscale.app.cluster_launch import Nodes
from trainscale.bench import process
from trainscale.bench.runner import run_grid
from trainscale.runtime.orphans import is_running, sigterm_as_interrupt
from trainscale.stops import Terminated

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    """The children a test started; whatever still runs at its end is killed."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def stopped_as_it_starts(start: Callable[..., subprocess.Popen], started: list) -> Callable[..., subprocess.Popen]:
    """``start``, then SIGTERM to this process before the child is handed back."""

    def start_then_stop(*args: Any, **kwargs: Any) -> subprocess.Popen:
        proc = start(*args, **kwargs)
        started.append(proc)
        signal.raise_signal(signal.SIGTERM)
        return proc

    return start_then_stop


def test_a_stop_while_a_node_starts_stops_that_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(subprocess, "Popen", stopped_as_it_starts(subprocess.Popen, started))
    status = Nodes([SLEEPER, SLEEPER], {}, None, tmp_path).run()
    assert status == 143 and "terminated; every node of the cluster job was stopped" in capsys.readouterr().err
    assert len(started) == 1, "the second node started after the stop"
    assert started[0].poll() is not None, "the node that was starting outlived the stop"


def test_a_stop_while_a_benchs_run_starts_stops_that_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list
) -> None:
    monkeypatch.setattr(process, "start", stopped_as_it_starts(process.start, started))
    with pytest.raises(Terminated), sigterm_as_interrupt():
        run_grid(options(tmp_path, fake_python(tmp_path), "[0.7, 0.1]"))
    assert len(started) == 1 and started[0].poll() is not None, "the run that was starting outlived the stop"


SLOW_TO_STOP = r"""
import signal, subprocess, sys, time
slow = (
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), exit(0)))\n"
    "print(flush=True); time.sleep(120)"
)
child = subprocess.Popen([sys.executable, "-c", slow], start_new_session=True, stdout=subprocess.PIPE)
child.stdout.readline()  # its handler is in place
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def test_a_stopped_run_is_waited_for_until_all_it_started_is_gone(tmp_path: Path) -> None:
    """The run ends at once on SIGTERM, its child (a node stopping its workers) a second later: the bench goes on
    only when both are gone."""
    pid_file = tmp_path / "child.pid"
    proc = process.start([sys.executable, "-c", SLOW_TO_STOP, str(pid_file)], tmp_path / "log", {})
    try:
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None, (tmp_path / "log").read_text()
            time.sleep(0.05)
        child = int(pid_file.read_text())
        process.stop(proc, grace=10)
        assert not is_running(child), "stop returned while the run's child was still stopping"
    finally:
        if pid_file.exists() and pid_file.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
