"""`trainscale cluster` for real: namespaces, a bridge and tc shapers. Needs root, ip and tc: skipped without
them, a failure under CI=true. Every test deletes what it created, also when it fails (``cluster_names``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.integration.cli import assert_one_line_error, run_cli
from trainscale.cli import main
from trainscale.runtime import cluster as net

pytestmark = pytest.mark.cluster


@pytest.fixture
def cluster_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """Unique cluster names for this test (``t`` + 6 hex), each brought down afterwards whatever happened;
    cluster state goes to a temporary folder."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        reason = f"needs root and iproute2's ip and tc (euid {os.geteuid()}, missing: {missing or 'none'})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason + " (CI=true: the cluster tests must run in CI)")
        pytest.skip(reason)
    monkeypatch.setenv("TRAINSCALE_CLUSTER_STATE", str(tmp_path / "state"))
    made: list[str] = []

    def new() -> str:
        made.append("t" + uuid.uuid4().hex[:6])
        return made[-1]

    yield new
    for name in made:
        net.destroy(name)
    leftovers = [ns for name in made for ns in net.trainscale_namespaces().get(name, [])]
    assert not leftovers, leftovers


def cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """The `trainscale cluster` command in this process (a subprocess costs seconds of imports each)."""
    code = main(["cluster", *args])
    out, err = capsys.readouterr()
    return code, out, err


def reachable(name: str, src: int, dst: int) -> bool:
    """A connection to a closed port is refused (a reset came back) only when the other host is reachable."""
    code = ("import socket, sys\ntry:\n socket.create_connection((sys.argv[1], 9), timeout=1.5)\n"
            "except ConnectionRefusedError:\n sys.exit(0)\nexcept OSError:\n sys.exit(1)\n")
    argv = net.in_namespace(name, src, [sys.executable, "-c", code, net.address(dst)])
    return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0


def test_up_status_down_two_clusters(cluster_names: Callable[[], str], capsys: pytest.CaptureFixture) -> None:
    a, b = cluster_names(), cluster_names()
    assert cli(capsys, "up", a, "--hosts", "2", "--bandwidth", "1gbit")[0] == 0
    assert cli(capsys, "up", b, "--hosts", "3", "--bandwidth", "1gbit,1gbit,100mbit")[0] == 0
    live = net.trainscale_namespaces()
    assert sorted(live[a]) == sorted(net.Cluster(a, (1,) * 2).namespaces)
    assert len(live[b]) == 4
    code, out, _ = cli(capsys, "status")
    assert code == 0
    for ns, address, rate in ((f"tsc-{a}-h1", "10.77.0.2", "1gbit"), (f"tsc-{b}-h2", "10.77.0.3", "100mbit")):
        line = next(x for x in out.splitlines() if ns in x)
        assert address in line and rate in line and " up " in line, out
    assert cli(capsys, "down", a)[0] == 0
    assert a not in net.trainscale_namespaces() and b in net.trainscale_namespaces()
    assert not (Path(os.environ["TRAINSCALE_CLUSTER_STATE"]) / f"{a}.json").exists()
    assert cli(capsys, "down", b)[0] == 0
    assert b not in net.trainscale_namespaces()


def test_status_reports_debris(cluster_names: Callable[[], str], capsys: pytest.CaptureFixture) -> None:
    name = cluster_names()
    cli(capsys, "up", name, "--hosts", "2", "--bandwidth", "1gbit")
    (Path(os.environ["TRAINSCALE_CLUSTER_STATE"]) / f"{name}.json").unlink()
    _, out, _ = cli(capsys, "status")
    assert f"tsc-{name}-sw" in out and "down --all" in out


def test_bad_inputs_are_one_line(cluster_names: Callable[[], str], capsys: pytest.CaptureFixture) -> None:
    name, unknown = cluster_names(), cluster_names()
    assert cli(capsys, "up", name, "--hosts", "2", "--bandwidth", "1gbit")[0] == 0
    cases = [(("up", name, "--hosts", "2", "--bandwidth", "1gbit"), "exists already"),
             (("up", unknown, "--hosts", "2", "--bandwidth", "1gbps"), "--bandwidth"),
             (("up", unknown, "--hosts", "1", "--bandwidth", "1gbit"), "--hosts"),
             (("up", unknown, "--hosts", "65", "--bandwidth", "1gbit"), "--hosts"),
             (("up", "bad_name", "--hosts", "2", "--bandwidth", "1gbit"), "cluster name"),
             (("status", unknown), "no cluster"), (("down", unknown), "no cluster"),
             (("link", unknown, "1", "down"), "no cluster"), (("link", name, "2", "down"), "HOST must be 0-1"),
             (("link", name, "1", "--bandwidth", "fast"), "--bandwidth")]
    for args, fragment in cases:
        code, _, err = cli(capsys, *args)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and fragment in lines[0], (args, err)
    assert unknown not in net.trainscale_namespaces()
    assert_one_line_error(run_cli("cluster", "status", unknown), "no cluster")


def test_sigint_during_up_leaves_nothing(cluster_names: Callable[[], str]) -> None:
    name = cluster_names()
    proc = subprocess.Popen([sys.executable, "-m", "trainscale", "cluster", "up", name, "--hosts", "64",
                             "--bandwidth", "1gbit"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(net.trainscale_namespaces().get(name, [])) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline, "up never started making namespaces"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert name not in net.trainscale_namespaces()
    assert not (Path(os.environ["TRAINSCALE_CLUSTER_STATE"]) / f"{name}.json").exists()


def test_shaped_links_and_a_straggler(cluster_names: Callable[[], str], capsys: pytest.CaptureFixture) -> None:
    name = cluster_names()
    assert cli(capsys, "up", name, "--hosts", "3", "--bandwidth", "200mbit,20mbit,200mbit")[0] == 0
    slow = net.measure(name, 0, 1, 4_000_000, 5)["seconds"]
    fast = net.measure(name, 0, 2, 4_000_000, 5)["seconds"]
    assert slow >= 1.3, slow  # 4 MB * 8 / 20 Mbit/s = 1.6 s
    assert fast * 4 < slow, (fast, slow)
    assert cli(capsys, "link", name, "1", "--bandwidth", "200mbit")[0] == 0
    restored = net.measure(name, 0, 1, 4_000_000, 5)["seconds"]
    assert restored * 4 < slow, (restored, slow)
    assert "200mbit" in next(x for x in cli(capsys, "status", name)[1].splitlines() if f"tsc-{name}-h1" in x)


def test_link_down_partitions_and_up_restores(cluster_names: Callable[[], str],
                                              capsys: pytest.CaptureFixture) -> None:
    name = cluster_names()
    assert cli(capsys, "up", name, "--hosts", "3", "--bandwidth", "1gbit")[0] == 0
    assert reachable(name, 0, 1) and reachable(name, 0, 2)
    assert cli(capsys, "link", name, "1", "down")[0] == 0
    assert not reachable(name, 0, 1) and reachable(name, 0, 2)
    assert " down " in next(x for x in cli(capsys, "status", name)[1].splitlines() if f"tsc-{name}-h1" in x)
    assert cli(capsys, "link", name, "h1", "up")[0] == 0
    assert reachable(name, 0, 1)
