import errno
import json
import os
import signal

import pytest
import torch

from trainscale.errors import ConfigError
from trainscale.io import append_jsonl, atomic_write_bytes, atomic_write_text
from trainscale.results import RunWriter
from trainscale.stops import stops_held
from trainscale.train.trainer import step_split


def row(epoch, acc):
    return {
        "epoch": epoch,
        "lr": 0.1,
        "train_loss": 1.0,
        "train_acc": 0.5,
        "test_loss": 1.1,
        "test_acc": acc,
        "epoch_seconds": 10.0,
        "eval_seconds": 1.0,
        "elapsed_seconds": 10.0 * epoch,
        "samples_per_sec": 100.0,
        "peak_memory_mb": 1.0,
    }


def test_metrics_and_dawnbench_tsv(tmp_path):
    writer = RunWriter(tmp_path)
    writer.add_epoch(row(1, 0.5))
    writer.add_epoch(row(2, float("nan")))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["epoch"] for x in lines] == [1, 2]
    assert json.loads(lines[1])["test_acc"] is None  # NaN is stored as null, never as invalid JSON
    tsv = (tmp_path / "logs.tsv").read_text().splitlines()
    assert tsv[0] == "epoch\thours\ttop1Accuracy"
    assert tsv[1].split("\t") == ["1", f"{10 / 3600:.8f}", "50.00"]


def test_restore_history_drops_epochs_after_the_checkpoint(tmp_path):
    writer = RunWriter(tmp_path)
    for e in (1, 2, 3):
        writer.add_epoch(row(e, 0.1 * e))
    again = RunWriter(tmp_path)
    again.restore_history(2)
    assert [r["epoch"] for r in again.history] == [1, 2]
    assert len((tmp_path / "logs.tsv").read_text().splitlines()) == 3


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left behind


class StoppedMidway:
    """A file whose second write brings ``sig``, as a stop that lands while torch.save is writing a checkpoint."""

    def __init__(self, f, sig):
        self.f, self.sig, self.writes = f, sig, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 2:
            signal.raise_signal(self.sig)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


class Stopped(KeyboardInterrupt):
    pass


def raise_stopped(signum, frame):
    raise Stopped


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_a_checkpoint_write_comes_after_it_and_leaves_the_whole_file(tmp_path, sig):
    """Before: the stop was raised inside torch.save's zip writer, which then failed with its own RuntimeError
    ("unexpected pos"): a traceback and status 1 instead of the stop's one line, and no checkpoint."""
    path = tmp_path / "checkpoint.pt"
    state = {"w": torch.arange(1000.0), "epoch": 3}
    previous = signal.signal(sig, raise_stopped)
    try:
        with pytest.raises(Stopped):
            atomic_write_bytes(path, lambda f: torch.save(state, StoppedMidway(f, sig)))
        assert signal.getsignal(sig) is raise_stopped
    finally:
        signal.signal(sig, previous)
    assert torch.equal(torch.load(path)["w"], state["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_second_stop_while_one_is_held_takes_effect_at_once():
    """A write that hangs can still be stopped: the second Ctrl-C is not held."""
    previous = signal.signal(signal.SIGINT, raise_stopped)
    reached = []
    try:
        with pytest.raises(Stopped), stops_held():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
        assert signal.getsignal(signal.SIGINT) is raise_stopped
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == ["after the first"]


class FullDisk:
    """A file on a disk that fills after its first write."""

    def __init__(self, f):
        self.f, self.writes = f, 0

    def write(self, data):
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def test_a_full_disk_is_one_line_naming_the_file_also_inside_torch_save(tmp_path, monkeypatch):
    """torch.save's zip writer turns the disk's OSError into its own RuntimeError ("unexpected pos"): before, a
    traceback. The old checkpoint stays, no temporary file is left, and an append says the same."""
    path = tmp_path / "checkpoint.pt"
    atomic_write_bytes(path, lambda f: torch.save({"epoch": 1}, f))
    with pytest.raises(ConfigError, match=r"cannot write .*checkpoint.pt \(No space left on device\): make room"):
        atomic_write_bytes(path, lambda f: torch.save({"w": torch.zeros(100)}, FullDisk(f)))
    assert torch.load(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("trainscale.io.dumps", full)
    with pytest.raises(ConfigError, match=r"cannot write .*metrics.jsonl \(No space left on device\)"):
        append_jsonl(tmp_path / "metrics.jsonl", {"epoch": 1})


def test_step_split_uses_the_same_steady_epochs_for_both_halves():
    rows = [
        {"step_seconds": 9.0, "comm_seconds_per_step": 5.0},
        {"step_seconds": 1.0, "comm_seconds_per_step": 0.25},
        {"step_seconds": 2.0, "comm_seconds_per_step": 0.75},
    ]
    assert step_split(rows) == {"step_seconds": 1.5, "comm_seconds_per_step": 0.5, "compute_seconds_per_step": 1.0}
    assert step_split(rows[:1]) == {"step_seconds": 9.0, "comm_seconds_per_step": 5.0, "compute_seconds_per_step": 4.0}
    assert step_split([{"step_seconds": 1.0}, {"step_seconds": 3.0}]) == {"step_seconds": 3.0}  # local: no split
    assert step_split([]) == {} and step_split([{"step_seconds": None}]) == {}


def strict_json(text):
    """JSON as every other reader parses it: no bare NaN, Infinity or -Infinity."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


EDGES = {"nan": float("nan"), "inf": float("inf"), "neg": [float("-inf"), 1.5], "ok": 2.0}


def test_benchmark_results_are_strict_json_on_nan_and_inf(tmp_path):
    from trainscale.bench.timing import Timing, save_result

    save_result(tmp_path / "r.json", {**EDGES, "timing": Timing([float("nan")])})
    data = strict_json((tmp_path / "r.json").read_text())
    assert data["nan"] is None and data["inf"] is None and data["neg"] == [None, 1.5] and data["ok"] == 2.0
    assert data["timing"]["seconds"] == [None]


def test_the_fault_log_and_json_helpers_are_strict_json(tmp_path):
    from trainscale.io import append_jsonl, dumps
    from trainscale.runtime import ft
    from trainscale.runtime.job import Job, installed

    assert strict_json(dumps(EDGES))["inf"] is None
    append_jsonl(tmp_path / "a.jsonl", EDGES)
    assert strict_json((tmp_path / "a.jsonl").read_text())["nan"] is None
    with installed(Job(fault_log=tmp_path / "events.jsonl", replica=0)):
        ft.log_event("fault", seconds=float("inf"))
    assert strict_json((tmp_path / "events.jsonl").read_text())["seconds"] is None
