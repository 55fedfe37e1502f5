"""Fault tolerance's pure parts: the fault flag, the data position across membership changes, the fault
record built from the replicas' events, and the one-line refusals before any replica starts."""

import copy
import threading
import time

import pytest
import torch

from tests.integration.cli import assert_one_line_error
from trainscale.app.ft_launch import fault_records
from trainscale.compression.collectives import done
from trainscale.compression.setup import CompressionPlan
from trainscale.errors import ConfigError
from trainscale.modes.fault_tolerance import (
    CommittingOptimizer,
    Position,
    ReplicaBatches,
    ReplicaSession,
    buckets,
    shared_compression_state,
)
from trainscale.runtime import faults
from trainscale.runtime.faults import InjectedFault, parse_injected_fault


def test_inject_fault_parses_kind_rank_and_step():
    assert parse_injected_fault("kill:1@20") == InjectedFault("kill", 1, 20)
    assert parse_injected_fault("hang:0@1") == InjectedFault("hang", 0, 1)
    assert parse_injected_fault("kill:s2@30") == InjectedFault("kill", 2, 30, server=True)
    assert parse_injected_fault("kill:s2@30").text == "kill:s2@30"


@pytest.mark.parametrize(
    "text", ["kill", "kill:1", "kill:x@3", "nap:1@3", "kill:1@0", "kill:-1@3", "kill:1@", "kill:s@3", "kill:ss1@3"]
)
def test_a_malformed_fault_names_the_format(text):
    with pytest.raises(ConfigError, match="KIND:RANK@STEP"):
        parse_injected_fault(text)


class FakeFull:
    """A whole epoch of ``n`` batches, batch i being the number i."""

    batch_size = 1

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
    ((flat, members),) = buckets(tensors)
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
    assert kill == {
        "kind": "kill",
        "rank": 1,
        "step": 5,
        "detection_seconds": pytest.approx(0.4),
        "recovery_seconds": pytest.approx(7.0),
        "steps_lost": 1,
    }
    assert hang["detection_seconds"] == pytest.approx(1.0) and hang["recovery_seconds"] is None
    assert hang["steps_lost"] == 0


def test_a_restarted_replica_meets_its_later_faults_but_never_repeats_one(tmp_path, monkeypatch):
    from trainscale.modes.fault_tolerance import unfired
    from trainscale.runtime import ft
    from trainscale.runtime.job import Job, installed

    with installed(Job(fault_log=tmp_path / ft.EVENTS_FILE)):  # the job's fault log, as the entry installs it
        faults = [InjectedFault("kill", 1, 5), InjectedFault("hang", 1, 40), InjectedFault("kill", 0, 9)]
        assert unfired(faults, 1) == faults[:2]  # a first attempt: all of its own
        ft.log_event("fault", kind="kill", rank=1, step=5)
        assert unfired(faults, 1) == [faults[1]]  # restarted after the first: the second is still to come
        assert unfired(faults, 0) == [faults[2]]


SMALL = ["train", "--model", "mlp", "--dataset", "synthetic", "--train-subset", "256", "--epochs", "1"]


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--workers", "2", "--inject-fault", "kill:1@3"], "--inject-fault needs --fault-tolerance"),
        (["--workers", "2", "--fault-tolerance", "--inject-fault", "kill:2@3"], "only 2 replicas"),
        (["--workers", "2", "--fault-tolerance", "--inject-fault", "kill:1"], "KIND:RANK@STEP"),
        (
            ["--workers", "2", "--fault-tolerance", "--mode", "async", "--servers", "1"],
            "is for --mode diloco, localsgd, sync",
        ),
        (["--workers", "2", "--fault-tolerance", "--ft-timeout", "0"], "--ft-timeout must be"),
        (["--workers", "2", "--fault-tolerance", "--inject-fault", "link:1@3"], "run with --cluster NAME"),
        (["--workers", "2", "--fault-tolerance", "--link-down", "0"], "--link-down must be a positive"),
        (["--workers", "2", "--fault-tolerance", "--link-down", "3"], "give one with --inject-fault link"),
        (["--workers", "2", "--link-down", "3"], "give one with --inject-fault link"),
        (
            [
                "--workers",
                "2",
                "--fault-tolerance",
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                "127.0.0.1:29400",
                "--inject-fault",
                "kill:4@3",
            ],
            "only 4 replicas",
        ),
    ],
)
def test_bad_fault_tolerance_settings_are_one_line(main_cli, tmp_path, flags, fragment):
    assert_one_line_error(main_cli(*SMALL, *flags, "--out", tmp_path / "run"), fragment)
    assert not (tmp_path / "run").exists()


def test_fault_tolerance_across_machines_needs_a_shared_run_folder(main_cli, tmp_path):
    """Any replica may take over writing the run: every machine must see one --out (no default per machine)."""
    assert_one_line_error(
        main_cli(*SMALL, "--workers", "2", "--fault-tolerance", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"),
        "needs --out",
    )


@pytest.mark.parametrize(
    "fault, fragment", [("link:0@3", "is on host 0"), ("link:1@3", "is on host 0"), ("kill:6@3", "only 6 replicas")]
)
def test_link_faults_on_a_cluster_spare_host_0_and_replicas_are_bounded(fault, fragment, monkeypatch):
    """On a cluster (its facts in the environment, as a node sees them) with 2 replicas per host for 3 hosts:
    replicas 0 and 1 are host 0's, which serves the lighthouse; a cut elsewhere is accepted."""
    from trainscale.app.config import build_config
    from trainscale.runtime.cluster import CLUSTER_ENV
    from trainscale.runtime.job import Job, installed

    base = {
        "model": "mlp",
        "dataset": "synthetic",
        "workers": 2,
        "fault_tolerance": True,
        "nnodes": 3,
        "rdzv_endpoint": "10.77.0.1:29400",
        "out": "/tmp/x",
    }
    with installed(Job.from_environ({CLUSTER_ENV: '{"name": "c"}'})):  # what a node's entry reads
        with pytest.raises(ConfigError, match=fragment):
            build_config({**base, "inject_fault": [fault]})
        assert build_config({**base, "inject_fault": ["link:2@3"], "link_down": 2.0}).faults.link_down == 2.0


class LoneTransport:
    """A quorum of one (the collectives are the identity)."""

    def size(self):
        return 1

    def rank(self):
        return 0

    def all_reduce(self, flat):
        return done(flat)

    def all_gather(self, out, source):
        out[0].copy_(source)
        return done(out)


class CommitSession:
    """A replica session whose next steps commit or abort as ``outcomes`` says (the exchange always runs)."""

    def __init__(self, outcomes):
        self.outcomes, self.stats, self.saved, self.compression = list(outcomes), [], [], None

    def transport(self):
        return LoneTransport()

    def average(self, tensors):
        pass

    def advance(self):
        pass

    def commit(self, exchange):
        exchange()
        return self.outcomes.pop(0)

    exchange_committed = ReplicaSession.exchange_committed  # the real one, over this session's commit


def compressed_optimizer(method, params, outcomes, error_feedback=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    # every tensor compressed (these are all small enough to go dense by default), so residuals exist to keep
    plan = CompressionPlan(method, "layerwise", params, error_feedback, 0, dense_below=0)
    session = CommitSession(outcomes)
    opt = CommittingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, session, plan)
    return model, session, opt


def one_step(model, session, opt):
    session.saved = [b.clone() for b in session.stats]
    opt.zero_grad()
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("method, params", [("topk", {"ratio": 0.1}), ("powersgd", {"rank": 1})])
def test_an_aborted_compressed_step_leaves_no_trace(method, params):
    model, session, opt = compressed_optimizer(method, params, [True, False])
    one_step(model, session, opt)
    before = (copy.deepcopy(model.state_dict()), opt.hook.state_dict())
    one_step(model, session, opt)  # aborted: weights, BN statistics, residuals, Q and step clock as they were
    after = (model.state_dict(), opt.hook.state_dict())
    for key in before[0]:
        assert torch.equal(before[0][key], after[0][key]), key
    assert before[1]["step"] == after[1]["step"] == 1
    old, new = leaves(before[1]["exchange"]), leaves(after[1]["exchange"])
    assert old.keys() == new.keys() and old
    for key in old:
        assert torch.equal(old[key], new[key]), key


def leaves(state, prefix=""):
    """Every tensor of a nested state dict, by its path."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def test_a_committed_compressed_step_sends_less_and_applies():
    model, session, opt = compressed_optimizer("topk", {"ratio": 0.1}, [True])
    start = copy.deepcopy(model.state_dict())
    one_step(model, session, opt)
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())
    stats = opt.hook.stats
    assert stats.steps == 1 and stats.bytes_sent < stats.dense_bytes / 3


def test_a_healing_replica_takes_shared_compressor_state_but_not_a_peers_residuals():
    for method, params, shared in [("powersgd", {"rank": 1}, True), ("topk", {"ratio": 0.1}, False)]:
        model, session, opt = compressed_optimizer(method, params, [True])
        one_step(model, session, opt)
        state = shared_compression_state(opt.hook)
        assert state["step"] == 1 and state["exchange"]["feedback"] == {"residuals": {}}
        assert bool(state["exchange"]["compressor"]) == shared, method
    assert shared_compression_state(None) is None


class FakeManager:
    def __init__(self, fail):
        self.fail, self.error = fail, None
        self._pg = self

    def errored(self):
        return self.error

    def report_error(self, exc):
        self.error = exc

    def allgather(self, out, source, opts):
        if self.fail:
            raise RuntimeError("Connection reset by peer")
        raise AssertionError("no collective once the step has failed")


def test_a_failed_all_gather_aborts_the_step_not_the_run():
    from trainscale.runtime.ft import QuorumTransport

    manager = FakeManager(fail=True)
    out = [torch.full((2,), 1e9), torch.full((2,), -1e9)]  # garbage: what empty slots hold
    assert QuorumTransport(manager).all_gather(out, torch.ones(2)).wait() is out
    assert isinstance(manager.error, RuntimeError)
    assert all(torch.equal(slot, torch.ones(2)) for slot in out)  # a payload the decoder can read
    manager.fail = False
    QuorumTransport(manager).all_gather(out, torch.ones(2))  # errored: nothing is launched


def test_a_fault_fires_once_when_two_threads_reach_it_together(monkeypatch):
    """A server's RPC threads can pass its fault's push count together: the fault is logged and met once (it was
    logged twice under load, and a test counting the firings saw two faults for one death)."""
    kills, events = [], []

    def slow_log(*args, **fields):
        time.sleep(0.05)  # the window in which the other thread arrives
        events.append(fields)

    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr(faults, "log_event", slow_log)
    monkeypatch.setattr(faults, "_FIRED", set())
    fault = faults.InjectedFault("kill", 1, 24, server=True)
    threads = [threading.Thread(target=fault.fire, kwargs={"version": v}) for v in (24, 25)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(kills) == 1 and len(events) == 1
    faults.InjectedFault("kill", 1, 30, server=True).fire()  # another fault still fires
    assert len(kills) == 2


class FakeReplica:
    def __init__(self, pid: int, events: list[tuple[str, int]], done: bool = False) -> None:
        self.pid, self.events, self.done = pid, events, done

    def poll(self) -> int | None:
        return 0 if self.done else None

    def wait(self) -> int:
        self.events.append(("wait", self.pid))
        return -9


def test_a_stopped_launcher_kills_every_replica_before_it_waits_for_any(monkeypatch):
    """Killed and reaped one by one, a replica lived on to log the end of the one before it as a failure below the
    launcher's one line for Ctrl-C."""
    from trainscale.modes.fault_tolerance import launcher

    events: list[tuple[str, int]] = []
    monkeypatch.setattr(launcher.os, "killpg", lambda pid, sig: events.append(("kill", pid)))
    launcher.kill_all([FakeReplica(1, events), FakeReplica(2, events, done=True), FakeReplica(3, events)])
    assert events == [("kill", 1), ("kill", 3), ("wait", 1), ("wait", 3)]
