"""The lock that lets ``make test`` run the multi-process tests two at a time (tests/conftest.py): tests marked
``alone`` run with nothing beside them, and one waiting to run is not overtaken by the tests that come after it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.conftest import machine


def test_an_alone_test_waits_for_the_one_running_and_the_next_waits_for_it(tmp_path: Path) -> None:
    gate, shared = tmp_path / "gate", tmp_path / "machine"
    gate.touch()
    shared.mkdir()
    events: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def test(name: str, alone: bool, started: threading.Event | None = None, until: threading.Event | None = None):
        with machine(alone, gate, shared):
            events.append(f"{name} in")
            if started:
                started.set()
            if until:
                until.wait(10)
            else:
                time.sleep(0.2)
            events.append(f"{name} out")

    first = threading.Thread(target=test, args=("first", False, first_in, release_first))
    first.start()
    assert first_in.wait(10)
    lone = threading.Thread(target=test, args=("alone", True))
    lone.start()
    time.sleep(0.5)  # the alone test is waiting for the first to end (it holds the gate)
    later = threading.Thread(target=test, args=("later", False))
    later.start()
    time.sleep(0.5)
    assert events == ["first in"]  # neither the alone test nor the later one got in beside the first
    release_first.set()
    for thread in (first, lone, later):
        thread.join(20)
    assert events == ["first in", "first out", "alone in", "alone out", "later in", "later out"]


def test_tests_that_share_run_side_by_side(tmp_path: Path) -> None:
    gate, shared = tmp_path / "gate", tmp_path / "machine"
    gate.touch()
    shared.mkdir()
    with machine(False, gate, shared), machine(False, gate, shared):
        pass  # a second share while the first is held: no wait
