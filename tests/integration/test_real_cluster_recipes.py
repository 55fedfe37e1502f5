"""The recipes for real machines in docs/data-parallel.md, run unchanged on a 2-host emulated cluster:
torchrun on every node,
the Slurm batch script (examples/slurm/train.sbatch, with stand-ins for srun and scontrol) and the commands
`trainscale train --hosts FILE` prints. Needs root, ip and tc (``cluster_names``: skipped without them, a
failure under CI=true). Every node process is killed and every cluster deleted, also when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.test_cluster import cluster_names, node_processes  # noqa: F401  (a fixture)
from trainscale.cli import main
from trainscale.runtime import cluster as net

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
HOSTS = 2
TIMEOUT_S = 300
TRAIN = (
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--train-subset",
    "512",
    "--test-subset",
    "128",
    "--epochs",
    "1",
    "--batch-size",
    "64",
    "--no-progress",
    "--threads",
    "1",
)


@pytest.fixture
def cluster(cluster_names: Callable[[], str]) -> Iterator[str]:  # noqa: F811
    """A 2-host cluster at 1gbit; whatever still runs on its hosts afterwards is killed before it is deleted."""
    name = cluster_names()
    assert main(["cluster", "up", name, "--hosts", str(HOSTS), "--bandwidth", "1gbit"]) == 0
    try:
        yield name
    finally:
        for pid in node_processes(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def venv_env() -> dict[str, str]:
    """This environment with the interpreter's bin folder first on PATH (where `trainscale` and `torchrun`
    are), as in a shell with the venv activated."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def run_nodes(argvs: list[list[str]], env: dict[str, str], logs: Path) -> list[tuple[int, str]]:
    """Start every node's command at once, wait for all; (exit status, end of its output) per node. Output
    goes to files: a node blocked on a full pipe would stall the whole job."""
    logs.mkdir()
    procs = []
    try:
        for i, argv in enumerate(argvs):
            with open(logs / f"node{i}.log", "w") as log:
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [(code, (logs / f"node{i}.log").read_text()[-3000:]) for i, code in enumerate(codes)]


def assert_one_sync_job(results: list[tuple[int, str]], out: Path) -> None:
    assert all(code == 0 for code, _ in results), results
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["mode"]) == (HOSTS, "sync")


def test_torchrun_on_every_node(cluster: str, tmp_path: Path) -> None:
    """torch's own launcher per node, c10d rendezvous at host 0; trainscale joins as a worker of it."""
    out = tmp_path / "run"
    argvs = [
        net.in_namespace(
            cluster,
            i,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(HOSTS),
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{net.address(0)}:29400",
                "--log-dir",  # torch's agent folder here, not left in /tmp
                str(tmp_path / f"agent{i}"),
                "-m",
                "trainscale",
                "train",
                *TRAIN,
                "--out",
                str(out),
            ],
        )
        for i in range(HOSTS)
    ]
    assert_one_sync_job(run_nodes(argvs, venv_env(), tmp_path / "logs"), out)


FAKE_SRUN = '''#!{python}
"""srun for the test: the command once per emulated host, inside its namespace, with Slurm's per-task
variables; like --kill-on-bad-exit, a failed task ends the others."""
import os, subprocess, sys, time
prefixes = {prefixes}
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
procs = [subprocess.Popen(prefix + args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                               "SLURM_NNODES": str(len(prefixes)), "SLURM_JOB_NODELIST": "h[0-1]"}})
         for i, prefix in enumerate(prefixes)]
while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
    time.sleep(0.2)
for p in procs:
    if p.poll() is None:
        p.kill()
sys.exit(max(p.wait() != 0 for p in procs))
'''

FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && [ "$3" = "h[0-1]" ] && printf 'h0\\nh1\\n'
"""


def fake_slurm(folder: Path, cluster: str) -> Path:
    """``srun`` and ``scontrol`` stand-ins in ``folder``; returns it (to go first on PATH)."""
    prefixes = [net.in_namespace(cluster, i, []) for i in range(HOSTS)]
    for name, text in (
        ("srun", FAKE_SRUN.format(python=sys.executable, prefixes=prefixes)),
        ("scontrol", FAKE_SCONTROL),
    ):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def test_slurm_batch_script(cluster: str, tmp_path: Path) -> None:
    """The script as the batch step runs it: srun starts one `trainscale train` per node, node 0 = host h0."""
    out = tmp_path / "run"
    bin_dir = fake_slurm(tmp_path, cluster)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",
        "TRAINSCALE_VENV": str(Path(sys.executable).parent.parent),
        "SLURM_NNODES": str(HOSTS),
        "SLURM_JOB_NODELIST": "h[0-1]",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
    }  # as in sbatch's batch step
    job = subprocess.run(
        ["bash", str(SBATCH), *TRAIN, "--out", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert_one_sync_job([(job.returncode, job.stdout[-3000:] + job.stderr[-3000:])], out)
    assert "results in" in job.stdout and "run folder is on node 0" in job.stdout


def printed_commands(stdout: str) -> list[tuple[str, list[str]]]:
    """(host, argv) per node from `train --hosts` output: ``# node I: HOST`` then the command line."""
    lines = stdout.splitlines()
    return [
        (line.split(": ", 1)[1], shlex.split(lines[n + 1]))
        for n, line in enumerate(lines)
        if line.startswith("# node ")
    ]


def test_hosts_file_commands(
    cluster: str, tmp_path: Path, main_cli: Callable[..., subprocess.CompletedProcess]
) -> None:
    """What `trainscale train --hosts FILE` prints (asked in this process), run as printed on the host each line
    names."""
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{net.address(i)}\n" for i in range(HOSTS)))
    out = tmp_path / "run"
    shown = main_cli("train", "--hosts", hosts, *TRAIN, "--out", out)
    assert shown.returncode == 0, shown.stderr
    commands = printed_commands(shown.stdout)
    assert [host for host, _ in commands] == [net.address(i) for i in range(HOSTS)], shown.stdout
    argvs = [net.in_namespace(cluster, i, argv) for i, (_, argv) in enumerate(commands)]
    assert_one_sync_job(run_nodes(argvs, venv_env(), tmp_path / "logs"), out)
