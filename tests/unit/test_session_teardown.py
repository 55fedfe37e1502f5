"""A run's trainer and model (DDP's wrapper holds the process group) are released inside the mode's session,
before the session destroys the group. Freed after it, when ``run_training`` returned, the group's destructor ran
in a worker holding Python's lock, waiting for gloo's thread, which was freeing a finished barrier's tensors and
waited for that lock: a deadlock, now and then, in a worker of a three-host job, whose other nodes' agents then
waited 300 s at their exit barrier."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from trainscale.app import run
from trainscale.app.config import build_config
from trainscale.runtime.job import this_job

SMALL = dict(model="mlp", dataset="synthetic", train_subset=128, test_subset=64, batch_size=64, epochs=1)


def watch(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the run's trainer was, and whether it was alive when the mode's session ended (after the session's
    collection of reference cycles, as the sync mode's does before it destroys the group)."""
    seen: dict[str, Any] = {}
    build, create = run.build_trainer, run.create_mode

    def built(*args: Any, **kwargs: Any) -> Any:
        trainer = build(*args, **kwargs)
        seen["trainer"], seen["model"] = weakref.ref(trainer), weakref.ref(trainer.train_model or trainer.model)
        return trainer

    def created(*args: Any, **kwargs: Any) -> Any:
        mode = create(*args, **kwargs)
        session = mode.session

        @contextlib.contextmanager
        def watched(device: Any) -> Iterator[None]:
            with session(device):
                try:
                    yield
                finally:
                    gc.collect()
                    seen["alive at the end"] = seen["trainer"]() is not None or seen["model"]() is not None

        mode.session = watched
        return mode

    monkeypatch.setattr(run, "build_trainer", built)
    monkeypatch.setattr(run, "create_mode", created)
    return seen


def test_the_trainer_is_gone_before_the_modes_session_ends(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    seen = watch(monkeypatch)
    summary, rows = run.run_training(build_config({**SMALL, "progress": False, "out": str(tmp_path / "run")}))
    assert summary["epochs_completed"] == 1 and len(rows) == 1
    assert seen["alive at the end"] is False


@pytest.mark.parametrize("launched", [True, False])
def test_a_failed_workers_trainer_goes_before_the_session_ends_a_local_runs_stays_to_debug(
    monkeypatch: pytest.MonkeyPatch, tmp_path, launched: bool
) -> None:
    """The traceback of a failure holds the frames that held the trainer: a worker's are cleared, so the trainer
    goes before the group is destroyed; a run in one process has no group, and keeps them for a debugger."""
    seen = watch(monkeypatch)
    monkeypatch.setattr(run.Trainer, "fit", lambda self: 1 / 0)
    job = dataclasses.replace(this_job(), launched=launched)
    with pytest.raises(ZeroDivisionError):
        run.run_training(build_config({**SMALL, "progress": False, "out": str(tmp_path / "run")}), job=job)
    assert seen["alive at the end"] is not launched
