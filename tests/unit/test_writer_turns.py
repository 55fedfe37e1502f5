"""The run folder written in turns (a fault-tolerant job's replicas, a parameter-server job's node-0 workers): when
the process that writes it dies around an epoch's end and another takes over, every epoch's row is there once, in
order. Real trainers (a tiny model on synthetic data, in this process) stand for the replicas; each is told when
it is elected to write, and the interleavings a replica's death makes are played in a fixed order."""

import json

import torch

from trainscale.app.config import build_config
from trainscale.app.run import build_trainer
from trainscale.modes.base import LocalMode
from trainscale.results import RunWriter, read_history
from trainscale.runtime.job import Job
from trainscale.train.callbacks import Writes

SMALL = dict(model="mlp", dataset="synthetic", train_subset=128, test_subset=64, batch_size=64, progress=False)


class Replica(LocalMode):
    """One replica of a job whose run folder several processes write in turns: at each epoch's end it writes
    when ``turns`` says it is elected; before its first epoch it heals from ``peer`` (a trainer) when given; as it
    restores a checkpoint it runs ``meanwhile`` (what the live replicas do while a restarted one resumes)."""

    standby_writer = True

    def __init__(self, turns, peer=None, meanwhile=None):
        super().__init__()
        self.turns, self.peer, self.meanwhile = list(turns), peer, meanwhile

    def writes_run_folder(self):
        return Writes.SHARED if self.turns.pop(0) else Writes.NOT_NOW

    def before_fit(self, snapshot, restore):
        if self.peer is not None:
            restore(self.peer.heal_state())

    def load_state_dict(self, state):
        if self.meanwhile is not None:
            self.meanwhile, then = None, self.meanwhile
            then()


def replica(out, epochs, mode, index, monkeypatch, restarts=0):
    """Replica ``index``'s trainer for ``epochs`` epochs (``restarts``: how often its agent restarted it)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts))
    cfg = build_config(SMALL, {"epochs": epochs, "out": str(out)})
    return build_trainer(cfg, torch.device("cpu"), mode, Job(replica=index, replicas=2, restarts=restarts))


def epochs_on_disk(out):
    return [json.loads(x)["epoch"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_restarted_replica_resuming_from_an_older_checkpoint_keeps_the_rows_written_since(tmp_path, monkeypatch):
    """The writer (replica 0) wrote epoch 1 and its checkpoint, then was killed in epoch 2. The survivor wrote epoch
    2 while the restarted replica 0 was loading the epoch-1 checkpoint; it then healed from the survivor and was
    elected for epoch 3. Epoch 2's row must survive the restart (it was lost: [1, 3])."""
    out = tmp_path / "run"
    replica(out, 1, Replica([True]), 0, monkeypatch).fit()  # wrote epoch 1, then killed
    survivor = replica(out, 2, Replica([False, True]), 1, monkeypatch)
    restarted = replica(out, 3, Replica([True], peer=survivor, meanwhile=survivor.fit), 0, monkeypatch, 1)
    assert epochs_on_disk(out) == [1, 2]
    restarted.fit()
    assert epochs_on_disk(out) == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_completed"] == 3 and summary["final_test_acc"] is not None


def test_an_epoch_whose_writer_died_before_writing_it_is_written_by_the_next(tmp_path, monkeypatch):
    """Replica 0 was elected for epoch 2 and killed before its row was written; replica 1, which finished epoch 2
    too, is elected for epoch 3: it writes epoch 2 from its own row, before its own epoch 3."""
    out = tmp_path / "run"
    replica(out, 1, Replica([True]), 0, monkeypatch).fit()  # epoch 2 ends, it dies before writing
    replica(out, 3, Replica([False, False, True]), 1, monkeypatch).fit()
    assert epochs_on_disk(out) == [1, 2, 3]


def test_a_writer_killed_before_writing_and_elected_again_after_its_restart_writes_the_epoch(tmp_path, monkeypatch):
    """As above, but the restarted replica 0 heals from replica 1 in epoch 3 and is elected for it: the row only
    replica 1 kept comes with the state it heals from."""
    out = tmp_path / "run"
    replica(out, 1, Replica([True]), 0, monkeypatch).fit()  # epoch 2 ends, it dies before writing
    survivor = replica(out, 2, Replica([False, False]), 1, monkeypatch)
    survivor.fit()
    replica(out, 3, Replica([True], peer=survivor), 0, monkeypatch, 1).fit()
    assert epochs_on_disk(out) == [1, 2, 3]
    assert read_history(out)[1] == survivor.writer.history[1]


def row(epoch, acc=0.5):
    return {"epoch": epoch, "test_acc": acc, "elapsed_seconds": 10.0 * epoch, "epoch_seconds": 10.0}


def test_a_restarted_writer_never_rewrites_the_rows_at_resume_and_its_turn_keeps_them(tmp_path):
    """Killed after writing epoch 2's row but before its checkpoint: the restarted writer resumes from epoch 1's
    checkpoint, while the folder (and the live writers) are past it."""
    first = RunWriter(tmp_path, shared=True)
    first.add_epoch(row(1))
    first.add_epoch(row(2, 0.6))
    restarted = RunWriter(tmp_path, clean=False, shared=True)
    restarted.restore_history(1)
    assert [r["epoch"] for r in restarted.history] == [1] and epochs_on_disk(tmp_path) == [1, 2]
    restarted.add_epoch(row(3))
    assert epochs_on_disk(tmp_path) == [1, 2, 3]
    assert [r["test_acc"] for r in restarted.history] == [0.5, 0.6, 0.5]  # epoch 2 as it was written
    assert len((tmp_path / "logs.tsv").read_text().splitlines()) == 4


def test_a_turn_prefers_the_rows_written_to_its_own_and_fills_only_what_is_missing(tmp_path):
    mine = RunWriter(tmp_path, shared=True)
    for epoch in (1, 2, 3):
        mine.keep_epoch(row(epoch, 0.1))
    RunWriter(tmp_path, clean=False, shared=True).add_epoch(row(1, 0.9))  # another wrote epoch 1 (then died)
    mine.add_epoch(row(4, 0.4))
    assert [(r["epoch"], r["test_acc"]) for r in read_history(tmp_path)] == [(1, 0.9), (2, 0.1), (3, 0.1), (4, 0.4)]


def test_a_job_restarted_from_an_older_checkpoint_replaces_the_epochs_it_trains_again(tmp_path):
    """Every writer died and the job went back to epoch 1's checkpoint: the rows after it are written again, each
    once (the rows the old attempt wrote after the checkpoint are replaced, never doubled)."""
    old = RunWriter(tmp_path, shared=True)
    for epoch in (1, 2, 3):
        old.add_epoch(row(epoch, 0.1))
    again = RunWriter(tmp_path, clean=False, shared=True)
    again.restore_history(1)
    again.add_epoch(row(2, 0.2))
    assert [(r["epoch"], r["test_acc"]) for r in read_history(tmp_path)] == [(1, 0.1), (2, 0.2)]
    again.add_epoch(row(3, 0.3))
    assert [(r["epoch"], r["test_acc"]) for r in read_history(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_a_replica_that_healed_as_the_epoch_ended_keeps_the_row_of_the_one_that_trained_it(tmp_path, monkeypatch):
    """Replica 0 was killed in epoch 2; the survivor trained and wrote it. Restarted from epoch 1's checkpoint,
    replica 0 healed just as epoch 2 ended, so it trained none of it, and was elected: its row (a training loss of
    0, an epoch of microseconds) must not replace the survivor's. One that trained steps of the epoch writes."""
    out = tmp_path / "run"
    replica(out, 1, Replica([True]), 0, monkeypatch).fit()
    survivor = replica(out, 2, Replica([False, True]), 1, monkeypatch)
    survivor.fit()
    restarted = replica(out, 2, Replica([True, True]), 0, monkeypatch, 1)
    restarted.trained_steps = 0
    restarted._record({**survivor.writer.history[1], "train_loss": 0.0, "epoch_seconds": 5e-5})
    assert read_history(out) == survivor.writer.history[:2]
    restarted.trained_steps = 1
    restarted._record({**survivor.writer.history[1], "train_loss": 0.0})
    assert epochs_on_disk(out) == [1, 2] and read_history(out)[1]["train_loss"] == 0.0
