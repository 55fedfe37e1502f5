"""Device utilisation per epoch: the CPU figure from the process's own CPU time."""

from __future__ import annotations

import time

import pytest
import torch

from trainscale.train.utilisation import Utilisation, allowed_cores


def test_cpu_time_over_wall_time_and_cores(monkeypatch):
    from trainscale.train import utilisation

    cpu, wall = iter([10.0, 10.9]), iter([100.0, 101.0])  # 0.9 CPU-seconds in 1 s of wall time
    monkeypatch.setattr(utilisation.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(utilisation.time, "perf_counter", lambda: next(wall))
    with Utilisation(torch.device("cpu"), cores=2.0) as u:
        pass
    assert u.result() == {"cpu_util": pytest.approx(0.45), "gpu_util": None}


def test_a_sleeping_process_is_idle():
    with Utilisation(torch.device("cpu"), cores=1.0) as idle:
        time.sleep(0.3)
    assert idle.result()["cpu_util"] < 0.2


def test_allowed_cores_follow_the_host_quota(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert allowed_cores(None, 1) == 2
    assert allowed_cores({"cpus_per_host": 0.5}, 1) == pytest.approx(0.5)
    assert allowed_cores({"cpus_per_host": 2.0}, 4) == pytest.approx(0.5)
