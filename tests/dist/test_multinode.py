"""The multi-node path on loopback: two `trainscale train --nnodes 2` agents meet at node 0's c10d
rendezvous, train as one world of 2, and node 0 alone writes the run folder."""

import json
import os
import subprocess
import sys

import pytest

from trainscale.runtime.network import free_port

SMALL = ("--model", "mlp", "--dataset", "synthetic", "--train-subset", "512", "--test-subset", "128",
         "--epochs", "2", "--batch-size", "64", "--no-progress", "--threads", "1")  # two "nodes", one CPU


def start_node(rank: int, endpoint: str, out) -> subprocess.Popen:
    argv = [sys.executable, "-m", "trainscale", "train", *SMALL, "--nnodes", "2", "--node-rank", str(rank),
            "--rdzv-endpoint", endpoint, "--workers", "1", "--rdzv-timeout", "120", "--out", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.dist
def test_two_nodes_on_loopback(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [start_node(0, endpoint, tmp_path / "run"), start_node(1, endpoint, tmp_path / "node1")]
    outputs = [p.communicate(timeout=300) for p in nodes]
    for p, (out, err) in zip(nodes, outputs):
        assert p.returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["world_size"], summary["mode"], summary["backend"]) == (2, "sync", "gloo")
    assert summary["epochs_completed"] == 2
    # Node 0's worker writes the run folder whichever global rank the c10d rendezvous gave it.
    assert not (tmp_path / "node1").exists()
    assert "results in" in outputs[0][0] and "run folder is on node 0" in outputs[1][0]
