"""The parameter-server worker's supervisor: how its training child starts, and what each way of ending becomes."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from trainscale.errors import ConfigError
from trainscale.modes.base import Result
from trainscale.modes.ps import supervisor
from trainscale.modes.ps.client import PSError


def trains() -> Result:
    return {"pid": os.getpid()}, [{"epoch": 1}]


def refuses() -> Result:
    raise ConfigError("--lr must be > 0")


def crashes() -> Result:
    raise RuntimeError("a bug")


def is_killed() -> Result:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def test_each_ending_of_the_child_reaches_the_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "start_method", lambda: "fork")
    summary, history = supervisor.supervise(trains, 0, stopped_limit_s=5.0)
    assert summary["pid"] != os.getpid() and history == [{"epoch": 1}]
    with pytest.raises(ConfigError, match="--lr must be > 0"):
        supervisor.supervise(refuses, 0, stopped_limit_s=5.0)
    with pytest.raises(PSError, match="RuntimeError: a bug"):
        supervisor.supervise(crashes, 0, stopped_limit_s=5.0)
    assert supervisor.supervise(is_killed, 0, stopped_limit_s=5.0) == ({}, [])


def test_the_child_is_forked_only_where_no_device_can_be_spoiled_by_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(sys, "platform", "linux")
    assert supervisor.start_method() == "fork"
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    assert supervisor.start_method() == "spawn"
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert supervisor.start_method() == "spawn"


def test_a_spawned_child_trains_as_a_forked_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start where CUDA is built in: the trainer crosses into a fresh interpreter."""
    monkeypatch.setattr(supervisor, "start_method", lambda: "spawn")
    summary, history = supervisor.supervise(trains, 0, stopped_limit_s=5.0)
    assert summary["pid"] != os.getpid() and history == [{"epoch": 1}]
