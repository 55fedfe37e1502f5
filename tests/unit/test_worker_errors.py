"""trainscale.runtime.worker_errors: a worker's exception reaches torch's elastic agent in the error-file
format the agent parses, and an interrupted write never leaves a half-written file for it to choke on."""

from __future__ import annotations

import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainscale.runtime.worker_errors import recorded


def boom() -> None:
    raise ValueError("boom at step 3")


def agent_view(path) -> ProcessFailure:
    """What torch's agent builds from a failed rank's error file."""
    return ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(path))


def test_the_exception_reaches_the_agent_whole(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(ValueError, match="boom at step 3"):
        recorded(boom)()
    failure = agent_view(path)
    assert failure.message["message"] == "ValueError: boom at step 3"
    assert "boom at step 3" in failure.message["extraInfo"]["py_callstack"]
    assert os.listdir(tmp_path) == ["error.json"]  # no temporary file left behind


def test_a_write_cut_short_leaves_no_file_rather_than_half_of_one(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def killed(*_args):  # the process dies between writing the temporary file and renaming it
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        recorded(boom)()
    assert os.listdir(tmp_path) == []
    assert agent_view(path).message.startswith("To enable traceback")  # torch's "no error file" case, no crash


def test_success_returns_the_value_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert recorded(lambda x: x * 2)(21) == 42
    assert os.listdir(tmp_path) == []


def bad_input() -> None:
    from trainscale.errors import ConfigError

    raise ConfigError("--lr must be positive")


def test_the_launcher_prints_the_root_causes_traceback_once_and_only_for_an_unexpected_error(tmp_path, monkeypatch):
    from trainscale.app.failures import root_traceback
    from trainscale.runtime.worker_errors import was_recorded

    for name, fn in (("bug", boom), ("input", bad_input)):
        path = tmp_path / f"{name}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        with pytest.raises(Exception) as caught:
            recorded(fn)()
        assert was_recorded(caught.value)  # so the worker itself stays quiet about it
    trace = root_traceback({1: agent_view(tmp_path / "bug.json")})
    assert trace.startswith("Traceback (most recent call last):") and trace.endswith("ValueError: boom at step 3")
    assert root_traceback({1: agent_view(tmp_path / "input.json")}) == ""  # bad input: its one line says it all
    assert not was_recorded(ValueError("never raised under an agent"))
