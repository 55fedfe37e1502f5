"""The multi-node path on loopback: two `trainscale train --nnodes 2` agents meet at node 0's c10d
rendezvous, train as one world of 2, and node 0 alone writes the run folder; a job restarted on both nodes
(``--max-restarts``) resumes there. One job proves both (a fault-free sync job here cost 8 s more and proved
nothing else: sync across nodes, through the same --nnodes launch, is tests/integration/test_cluster.py's, equal
to local processes to the bit)."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from trainscale.runtime.network import free_port

SMALL = (
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--train-subset",
    "512",
    "--test-subset",
    "128",
    "--epochs",
    "2",
    "--batch-size",
    "64",
    "--no-progress",
    "--threads",
    "1",
)  # two "nodes", one CPU


def start_node(rank: int, endpoint: str, out, *extra: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "trainscale",
        "train",
        *SMALL,
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--rdzv-endpoint",
        endpoint,
        "--workers",
        "1",
        "--rdzv-timeout",
        "120",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


@pytest.mark.dist
def test_a_server_killed_on_one_node_restarts_the_job_on_both_and_it_resumes(tmp_path):
    """A parameter server (one per node) dies at its 24th push, in epoch 2 (16 batches an epoch, each pushed to
    each shard). Only its node's agent counts a restart: the other one restarts its processes for the new
    rendezvous round with its count still 0, so the job must agree it restarted (node 0's main worker resumes
    its run folder instead of refusing it as another run's), and the victim's node, whose faults no shared log
    records, must not fire the fault again."""
    endpoint = f"127.0.0.1:{free_port()}"
    ps = ("--mode", "async", "--servers", "1", "--epochs", "3", "--max-restarts", "1", "--inject-fault", "kill:s1@24")
    nodes = [start_node(0, endpoint, tmp_path / "run", *ps), start_node(1, endpoint, tmp_path / "node1", *ps)]
    outputs = [p.communicate(timeout=300) for p in nodes]
    for p, (_out, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    errs = "".join(err for _, err in outputs)
    assert errs.count("--inject-fault kill:s1@24 fires") == 1 and "never fired" not in errs
    assert "resumed from" in errs
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["epochs_completed"] == 3 and summary["servers"] == 2
    assert (summary["world_size"], summary["mode"]) == (2, "async")
    # Node 0's worker writes the run folder whichever global rank the c10d rendezvous gave it, restarted too.
    assert not (tmp_path / "node1").exists()
    assert "results in" in outputs[0][0] and "run folder is on node 0" in outputs[1][0]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]


@pytest.mark.dist
def test_a_refusal_on_a_node_that_does_not_host_ends_the_other_at_once(tmp_path, monkeypatch):
    """With --max-restarts a worker's refusal ends its node's job without a restart (a restart meets it again);
    the node closes the rendezvous as it goes, so node 0 ends too, saying another node ended the job, instead of
    waiting --rdzv-timeout (120 s here) for a node that will not come back."""
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    host = start_node(0, endpoint, tmp_path / "run", "--max-restarts", "2")
    monkeypatch.setenv("TRAINSCALE_FAULT", "refuse:rank=any:epoch=1:step=2")  # node 1's worker, whatever its rank
    other = start_node(1, endpoint, tmp_path / "node1", "--max-restarts", "2")
    (_, host_err), (_, other_err) = host.communicate(timeout=300), other.communicate(timeout=300)
    assert time.monotonic() - start < 60, host_err[-3000:]
    assert other.returncode == 2, other_err[-3000:]
    assert re.fullmatch(
        r"trainscale train: error: worker rank \d \(local rank 0\) failed: ConfigError: TRAINSCALE_FAULT: "
        r"injected refusal in rank \d at epoch 1 step 2",
        other_err.strip().splitlines()[-1],
    ), other_err[-3000:]
    assert host.returncode == 1, host_err[-3000:]
    assert host_err.strip().splitlines()[-1] == (
        f"trainscale train: error: another node ended the job (it closed the rendezvous at {endpoint}); "
        "its own output says why"
    ), host_err[-3000:]


@pytest.mark.dist
def test_a_refusal_on_node_0_ends_the_other_node_with_one_line(tmp_path, monkeypatch):
    """Node 0 hosts the rendezvous store, so its end takes the store along: the other node ends at once too, with
    one line of its own (before: about 30 lines of torch's C++ warnings of the lost store, stacks included, and
    'RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for details.')."""
    endpoint = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("TRAINSCALE_FAULT", "refuse:rank=any:epoch=1:step=2")  # node 0's worker, whatever its rank
    host = start_node(0, endpoint, tmp_path / "run", "--max-restarts", "2")
    monkeypatch.delenv("TRAINSCALE_FAULT")
    other = start_node(1, endpoint, tmp_path / "node1", "--max-restarts", "2")
    (_, host_err), (_, other_err) = host.communicate(timeout=300), other.communicate(timeout=300)
    assert host.returncode == 2 and "injected refusal" in host_err.strip().splitlines()[-1], host_err[-3000:]
    assert other.returncode == 1, other_err[-3000:]
    said = [x for x in other_err.splitlines() if " INFO " not in x and "failed (exitcode: " not in x]
    assert said == [
        f"trainscale train: error: lost the rendezvous at {endpoint}: node 0's launcher ended or cannot be reached; "
        "its own output says why"
    ], other_err[-3000:]
