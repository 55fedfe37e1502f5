"""Sync-mode settings: flags, mode resolution, hosts files, fault specs, failure messages, scaling."""

import os
import socket
from types import SimpleNamespace

import pytest

from trainscale.app.config import build_config
from trainscale.app.failures import describe_failure
from trainscale.app.hosts import node_commands, parse_hosts
from trainscale.app.worker_env import to_argv
from trainscale.cli import build_parser
from trainscale.errors import ConfigError
from trainscale.runtime.faults import Fault, parse_fault
from trainscale.runtime.network import check_port_free, parse_endpoint, wait_reachable
from trainscale.train.scaling import config_mismatches, scaling_efficiency
from trainscale.train.setup import check_fits


def parse(*argv):
    args = build_parser().parse_args(["train", *argv])
    return {k: v for k, v in vars(args).items() if k != "command"}


@pytest.mark.parametrize(
    "layer, env_world, expected",
    [
        ({}, None, ("local", 1)),
        ({"workers": 2}, None, ("sync", 2)),
        ({"devices": [0, 1, 2]}, None, ("sync", 3)),
        ({"nnodes": 2, "rdzv_endpoint": "h:1"}, None, ("sync", 1)),
        ({}, "4", ("sync", 1)),
        ({"mode": "sync"}, None, ("sync", 1)),
    ],
)
def test_mode_resolution(monkeypatch, layer, env_world, expected):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if env_world:
        monkeypatch.setenv("WORLD_SIZE", env_world)
    cfg = build_config(layer)
    assert (cfg.run.mode, cfg.launch.workers) == expected


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"mode": "local", "workers": 2}, "--mode local trains in one process but --workers 2"),
        ({"workers": 0}, "--workers must be a positive integer"),
        ({"nnodes": 2}, "--nnodes > 1 needs --rdzv-endpoint"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "--node-rank must be in 0..1"),
        ({"rdzv_endpoint": "nohostport"}, "--rdzv-endpoint must be HOST:PORT"),
        ({"devices": [0, 0]}, "distinct GPU indices"),
        ({"devices": [0, 1], "workers": 4}, "one worker per GPU"),
        ({"backend": "mpi"}, "--backend must be one of"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"ssh": True}, "--ssh runs the per-node commands of --hosts"),
    ],
)
def test_bad_parallel_settings(monkeypatch, bad, fragment):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=fragment):
        build_config(bad)


def test_gpus_is_an_alias_of_devices():
    assert parse("--gpus", "0,1,2,3")["devices"] == [0, 1, 2, 3]
    assert parse("--devices", "1")["devices"] == [1]


def test_flags_round_trip_through_to_argv():
    flags = parse(
        "--model",
        "mlp",
        "--workers",
        "2",
        "--no-flip",
        "--sync-bn",
        "--milestones",
        "3,5",
        "--lr",
        "0.05",
        "--out",
        "runs/x",
    )
    assert parse(*to_argv(flags)) == flags


def test_check_fits_names_workers_and_samples():
    cfg = build_config({"batch_size": 4})
    with pytest.raises(ConfigError, match="world size 4 is larger than the 3 samples"):
        check_fits(cfg, 3, 100, 4)
    with pytest.raises(ConfigError, match="batch size 64 per worker is larger than the 50 training samples"):
        check_fits(build_config({"batch_per_worker": 64}), 100, 100, 2)
    assert check_fits(build_config({"batch_size": 64}), 128, 10, 2).per_worker == 32


def test_hosts_file_gives_one_command_per_node(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode-a slots=4\n\nnode-b slots=4  # second\n")
    hosts = parse_hosts(path)
    flags = parse("--model", "resnet20", "--hosts", str(path), "--batch-size", "512")
    cfg = build_config({k: v for k, v in flags.items()})
    commands = node_commands(cfg, flags, hosts)
    assert [h for h, _ in commands] == ["node-a", "node-b"]
    for rank, (_, argv) in enumerate(commands):
        assert argv[:2] == ["trainscale", "train"]
        node = parse(*argv[2:])
        assert (node["nnodes"], node["node_rank"], node["workers"]) == (2, rank, 4)
        assert node["rdzv_endpoint"] == "node-a:29400" and node["rdzv_id"] == "trainscale"
        assert "hosts" not in node and node["model"] == "resnet20"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("a slots=2\nb slots=4\n", "same slots="),
        ("a slots=x\n", "hosts:1: expected 'host' or 'host slots=N'"),
        ("\n# nothing\n", "lists no hosts"),
    ],
)
def test_bad_hosts_files(tmp_path, text, fragment):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        parse_hosts(path)


def test_fault_spec():
    assert parse_fault("kill:rank=1:epoch=2:step=3") == Fault("kill", 1, 2, 3)
    assert parse_fault("refuse:rank=any:epoch=2:step=3") == Fault("refuse", None, 2, 3)
    for bad in ("explode:rank=1:epoch=1:step=0", "kill:rank=1", "raise:rank=a:epoch=1:step=0"):
        with pytest.raises(ConfigError, match="ACTION:rank=R:epoch=E:step=S"):
            parse_fault(bad)


def failure(message, exitcode=1, timestamp=100, local_rank=0):
    return SimpleNamespace(
        message=message, exitcode=exitcode, timestamp=timestamp, local_rank=local_rank, signal_name=lambda: "SIGKILL"
    )


def test_root_cause_prefers_the_real_error_over_its_consequences():
    failures = {
        0: failure({"message": "DistBackendError: [gloo] Connection closed by peer", "kind": "peer"}, timestamp=99),
        1: failure({"message": "RuntimeError: boom", "kind": "error", "extraInfo": {}}, local_rank=1),
    }
    line, status = describe_failure(failures)
    assert line.startswith("worker rank 1 (local rank 1) failed: RuntimeError: boom") and status == 1
    assert "other workers were stopped (rank 0)" in line
    stopped = {0: failure("", exitcode=-15, timestamp=1), 2: failure({"message": "ValueError: x"}, local_rank=2)}
    assert describe_failure(stopped)[0].startswith("worker rank 2 (local rank 2) failed: ValueError: x")
    killed, _ = describe_failure({3: failure("Signal 9 (SIGKILL) received by PID 7", exitcode=-9)})
    assert "rank 3" in killed and "Signal 9" in killed
    _, status = describe_failure({0: failure({"message": "ConfigError: bad"}, exitcode=2)})
    assert status == 2
    _, status = describe_failure({0: failure({"message": "DataError: gone", "kind": "user"}, exitcode=1)})
    assert status == 2


def test_failure_kinds_come_from_the_exception_type_not_its_text():
    import torch.distributed as dist

    from trainscale.errors import DataError
    from trainscale.modes.ps.client import ServerLost
    from trainscale.runtime.worker_errors import kind_of

    assert kind_of(DataError("missing")) == "user"
    assert kind_of(dist.DistBackendError("anything")) == kind_of(ServerLost("x")) == "peer"
    assert kind_of(RuntimeError("Connection closed by peer")) == "error"  # the text alone decides nothing
    peer = failure({"message": "RuntimeError: Connection closed by peer", "kind": "error"}, timestamp=1)
    root = failure({"message": "ValueError: later", "kind": "error"}, timestamp=5, local_rank=1)
    assert describe_failure({0: peer, 1: root})[0].startswith("worker rank 0")
    # Within one second the worker's own nanosecond stamp decides: the root cause records before its peers.
    late = failure(
        {"message": "RuntimeError: callback failed", "kind": "error", "time_ns": 7 * 10**9 + 900}, timestamp=7
    )
    early = failure(
        {"message": "RuntimeError: injected", "kind": "error", "time_ns": 7 * 10**9 + 100}, timestamp=7, local_rank=1
    )
    assert describe_failure({0: late, 1: early})[0].startswith(
        "worker rank 1 (local rank 1) failed: RuntimeError: injected"
    )
    assert describe_failure(
        {
            0: failure("Signal 15 (SIGTERM) received by PID 9", exitcode=-15, timestamp=1),
            1: failure("", exitcode=-9, timestamp=5),
        }
    )[0].startswith("worker rank 1")


def test_a_refusal_is_handed_to_the_launcher_once_whole_and_wakes_its_agent(tmp_path, monkeypatch):
    """A worker's refusal where restarts would meet it again (``refuse_job``): the first refusing process publishes
    its line and sends its launcher SIGTERM (the agent then stops the job); a second refusal, as every rank meeting
    the same bad input, leaves the first line and signals nothing; a fault-tolerant replica's launcher watches the
    file, so it is not signalled; no job asked for it (no ``Job.refusal``): nothing happens."""
    import signal

    from trainscale.app import failures as module
    from trainscale.runtime.job import Job

    monkeypatch.setattr(module, "REFUSAL_WAIT_S", 0.0)
    woken: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda sig, frame: woken.append(sig))
    try:
        path = tmp_path / "refusal"
        module.refuse_job(Job(rank=3, local_rank=1, launcher_pid=os.getpid()), ConfigError("full"))
        assert not path.exists() and woken == []
        module.refuse_job(Job(rank=3, local_rank=1, refusal=path, launcher_pid=os.getpid()), ConfigError("full"))
        assert path.read_text() == "worker rank 3 (local rank 1) failed: ConfigError: full\n"
        assert woken == [signal.SIGTERM]
        server = Job(rank=4, local_rank=2, refusal=path, launcher_pid=os.getpid())
        module.refuse_job(server, ConfigError("later"), first_server=2)
        assert path.read_text().startswith("worker rank 3") and woken == [signal.SIGTERM]
        path.unlink()
        module.refuse_job(server, ConfigError("bad"), first_server=2)
        assert path.read_text().startswith("parameter server rank 4 (local rank 2) failed: ConfigError: bad")
        path.unlink()
        module.refuse_job(Job(replica=1, refusal=path, launcher_pid=os.getpid()), ConfigError("full"))
        assert path.read_text() == "replica 1: full\n" and len(woken) == 2
    finally:
        signal.signal(signal.SIGTERM, before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["refusal"]  # no partial file beside it


def test_scaling_efficiency():
    base = {
        "world_size": 1,
        "samples_per_sec": 1000.0,
        "model": "m",
        "dataset": "d",
        "precision": "bf16",
        "image_size": 32,
    }
    run = {**base, "world_size": 4, "samples_per_sec": 3000.0}
    assert scaling_efficiency(run, base) == pytest.approx(0.75)
    steady = {**run, "steady_epoch_seconds": 10.0, "train_samples_per_epoch": 36000}
    assert scaling_efficiency(steady, base) == pytest.approx(0.9)
    assert config_mismatches({**run, "precision": "fp32"}, base) == ["precision: 'bf16' vs 'fp32'"]


def test_endpoint_checks():
    assert parse_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is busy; pass --rdzv-endpoint 127.0.0.1:"):
            check_port_free("127.0.0.1", port)
        wait_reachable("127.0.0.1", port, timeout_s=1)
    with pytest.raises(ConfigError, match="cannot reach the rendezvous endpoint"):
        wait_reachable("127.0.0.1", port, timeout_s=0.5)


def test_free_port_picks_below_the_ephemeral_range_where_there_is_room(tmp_path, monkeypatch):
    """A port another process binds later comes from below the kernel's ephemeral range, which outgoing connections
    draw from (one took a port so picked, in CI, before the store bound it); with no room there, the kernel's pick."""
    import trainscale.runtime.network as network

    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    ranges = tmp_path / "range"
    for text, below in (("32768\t60999\n", True), ("1024 65535\n", False), ("", False)):
        ranges.write_text(text)
        monkeypatch.setattr(network, "EPHEMERAL_RANGE", ranges)
        ports = {network.free_port() for _ in range(20)}
        assert all(bindable(port) for port in ports)
        if below:
            assert all(network.LOWEST_PICKED_PORT <= port < 32768 for port in ports) and len(ports) > 1
    monkeypatch.setattr(network, "_bindable", lambda host, port: False)  # every pick taken: the kernel's
    ranges.write_text("32768 60999\n")
    assert network.free_port() > 0


def test_a_lost_rendezvous_is_named_by_what_ended_it():
    """A closed rendezvous is another node's end; a lost store, node 0's (never said on node 0 itself, whose own
    store it is); anything else keeps torch's words."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from trainscale.app.launch import LaunchPlan, rendezvous_failure

    node1, node0 = LaunchPlan("h:29400", False, "r", None, 1), LaunchPlan("h:29400", True, "r", None, 1)
    assert rendezvous_failure(RendezvousClosedError(), node1).startswith("another node ended the job (it closed")
    assert rendezvous_failure(RendezvousConnectionError("x"), node1).startswith("lost the rendezvous at h:29400")
    assert rendezvous_failure(RendezvousConnectionError("x"), node0) == (
        "rendezvous at h:29400 failed: RendezvousConnectionError: x"
    )
    assert "RendezvousTimeoutError" in rendezvous_failure(RendezvousTimeoutError("late"), node1)
