"""Fault tolerance's pure parts: the fault flag, the data position across membership changes, the fault
record built from the replicas' events, and the one-line refusals before any replica starts."""

import pytest
import torch

from tests.integration.cli import assert_one_line_error, run_cli
from trainscale.app.ft_launch import fault_records
from trainscale.errors import ConfigError
from trainscale.modes.fault_tolerance import Position, ReplicaBatches, buckets
from trainscale.runtime.faults import InjectedFault, parse_injected_fault


def test_inject_fault_parses_kind_rank_and_step():
    assert parse_injected_fault("kill:1@20") == InjectedFault("kill", 1, 20)
    assert parse_injected_fault("hang:0@1") == InjectedFault("hang", 0, 1)


@pytest.mark.parametrize("text", ["kill", "kill:1", "kill:x@3", "nap:1@3", "kill:1@0", "kill:-1@3", "kill:1@"])
def test_a_malformed_fault_names_the_format(text):
    with pytest.raises(ConfigError, match="KIND:RANK@STEP"):
        parse_injected_fault(text)


class FakeFull:
    """A whole epoch of ``n`` batches, batch i being the number i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def lazy_epoch(self, epoch):
        return (lambda i=i: i for i in range(self.n))


class FakeSession:
    """One member's view of a quorum whose size follows ``sizes`` step by step; every step commits."""

    def __init__(self, sizes, member):
        self.sizes, self.member = list(sizes), member
        self.position, self.fresh, self.members, self.member_rank = Position(), False, 0, 0
        self.stats, self.saved = [], []  # no BatchNorm statistics to save before a step

    def quorum(self):
        self.members = self.sizes.pop(0) if self.sizes else self.members
        self.member_rank = min(self.member, self.members - 1)
        self.fresh = True


def walk(sizes, n=20):
    """The batches each member rank trains on, step by step, committing every step."""
    sessions = [FakeSession(sizes, m) for m in range(max(sizes))]
    iters = [iter(ReplicaBatches(FakeFull(n), s).epoch(0)) for s in sessions]
    steps = []
    while True:
        taken = [next(it, None) for it in iters]
        live = [t for s, t in zip(sessions, taken) if t is not None and s.member < s.members]
        if not live:
            return steps
        steps.append(sorted(live))
        for s in sessions:
            s.position.batches += s.members


def test_committed_steps_never_repeat_or_skip_a_batch_while_members_change():
    steps = walk([3, 3, 2, 2, 3, 1, 1, 3, 3, 3])
    seen = [b for step in steps for b in step]
    assert len(seen) == len(set(seen)), steps  # no batch twice
    assert seen == list(range(len(seen))), steps  # none skipped: the epoch is walked in order
    assert 20 - len(seen) < 3  # what is left is less than one step of the largest quorum


def test_buckets_hold_every_tensor_in_order():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    (flat, members), = buckets(tensors)
    assert flat.numel() == 12 + 5 + 8 and members == tensors
    assert torch.equal(flat[:12], tensors[0].flatten())


def test_fault_records_from_events():
    events = [
        {"event": "members", "time": 0.0, "replica": 0, "step": 1, "members": 2},
        {"event": "fault", "time": 10.0, "replica": 1, "kind": "kill", "rank": 1, "step": 5},
        {"event": "aborted", "time": 10.4, "replica": 0, "step": 5},
        {"event": "members", "time": 10.5, "replica": 0, "step": 5, "members": 1},
        {"event": "healed", "time": 17.0, "replica": 1, "step": 80},
        {"event": "members", "time": 17.0, "replica": 0, "step": 80, "members": 2},
        {"event": "fault", "time": 20.0, "replica": 0, "kind": "hang", "rank": 0, "step": 120},
        {"event": "members", "time": 21.0, "replica": 1, "step": 120, "members": 1},
    ]
    kill, hang = fault_records(events)
    assert kill == {"kind": "kill", "rank": 1, "step": 5, "detection_seconds": pytest.approx(0.4),
                    "recovery_seconds": pytest.approx(7.0), "steps_lost": 1}
    assert hang["detection_seconds"] == pytest.approx(1.0) and hang["recovery_seconds"] is None
    assert hang["steps_lost"] == 0


def test_a_restarted_replica_meets_its_later_faults_but_never_repeats_one(tmp_path, monkeypatch):
    from trainscale.modes.fault_tolerance import unfired
    from trainscale.runtime import ft

    monkeypatch.setenv(ft.EVENTS_ENV, str(tmp_path / ft.EVENTS_FILE))
    faults = [InjectedFault("kill", 1, 5), InjectedFault("hang", 1, 40), InjectedFault("kill", 0, 9)]
    assert unfired(faults, 1) == faults[:2]  # a first attempt: all of its own
    ft.log_event("fault", kind="kill", rank=1, step=5)
    assert unfired(faults, 1) == [faults[1]]  # restarted after the first: the second is still to come
    assert unfired(faults, 0) == [faults[2]]


SMALL = ["train", "--model", "mlp", "--dataset", "synthetic", "--train-subset", "256", "--epochs", "1"]


@pytest.mark.parametrize("flags, fragment", [
    (["--workers", "2", "--inject-fault", "kill:1@3"], "--inject-fault needs --fault-tolerance"),
    (["--workers", "2", "--fault-tolerance", "--inject-fault", "kill:2@3"], "only 2 replicas"),
    (["--workers", "2", "--fault-tolerance", "--inject-fault", "kill:1"], "KIND:RANK@STEP"),
    (["--workers", "2", "--fault-tolerance", "--mode", "localsgd"], "works with --mode sync so far"),
    (["--workers", "2", "--fault-tolerance", "--compress", "topk"], "drop --compress"),
    (["--workers", "2", "--fault-tolerance", "--ft-timeout", "0"], "--ft-timeout must be"),
])
def test_bad_fault_tolerance_settings_are_one_line(tmp_path, flags, fragment):
    assert_one_line_error(run_cli(*SMALL, *flags, "--out", tmp_path / "run"), fragment)
    assert not (tmp_path / "run").exists()
