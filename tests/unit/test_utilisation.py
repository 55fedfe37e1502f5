"""Device utilisation per epoch: the CPU figure from the process's own CPU time."""

from __future__ import annotations

import time

import pytest
import torch

from trainscale.train import utilisation
from trainscale.train.utilisation import Utilisation, allowed_cores


def test_cpu_time_over_wall_time_and_cores(monkeypatch):
    from trainscale.train import utilisation

    cpu, wall = iter([10.0, 10.9]), iter([100.0, 101.0])  # 0.9 CPU-seconds in 1 s of wall time
    monkeypatch.setattr(utilisation.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(utilisation.time, "perf_counter", lambda: next(wall))
    with Utilisation(torch.device("cpu"), cores=2.0) as u:
        pass
    assert u.result() == {"cpu_util": pytest.approx(0.45), "gpu_util": None, "gpu_clock_mhz": None, "gpu_power_w": None}


def test_a_sleeping_process_is_idle():
    with Utilisation(torch.device("cpu"), cores=1.0) as idle:
        time.sleep(0.3)
    assert idle.result()["cpu_util"] < 0.2


def test_allowed_cores_follow_the_host_quota(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert allowed_cores(None, 1) == 2
    assert allowed_cores({"cpus_per_host": 0.5}, 1) == pytest.approx(0.5)
    assert allowed_cores({"cpus_per_host": 2.0}, 4) == pytest.approx(0.5)


def test_gpu_utilisation_from_nvml_even_for_a_pass_shorter_than_the_period(monkeypatch):
    readings = iter([80, 80])  # the probe at entry, then the one sample at exit
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: next(readings))
    with Utilisation(torch.device("cuda", 0), cores=1.0, period=10.0) as short:
        pass
    assert short.result()["gpu_util"] == pytest.approx(0.8)


def test_gpu_utilisation_is_the_mean_of_the_samples(monkeypatch):
    readings = iter([100] + [50] * 100_000)  # the probe at entry is not a sample
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: next(readings))
    with Utilisation(torch.device("cuda", 0), cores=1.0, period=0.01) as u:
        while len(u.samples) < 2:
            time.sleep(0.005)
    assert u.result()["gpu_util"] == pytest.approx(0.5)


def test_no_gpu_figure_without_nvml_and_one_warning_that_says_why(monkeypatch, caplog):
    def missing(device=None):
        raise ModuleNotFoundError("No module named 'pynvml'")

    monkeypatch.setattr(torch.cuda, "utilization", missing)
    utilisation._warn_once.cache_clear()
    for _ in range(3):
        with Utilisation(torch.device("cuda", 0), cores=1.0) as u:
            pass
        assert u.result()["gpu_util"] is None
    warnings = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert len(warnings) == 1 and "pynvml" in warnings[0] and "nvidia-ml-py" in warnings[0], warnings


def test_the_gpus_clock_and_power_are_the_means_of_the_samples(monkeypatch):
    """A throttled GPU shows as a lower clock; NVML gives the power in milliwatts."""
    clocks, powers = iter([1980, 1980, 1755] * 100_000), iter([500_000, 700_000] * 100_000)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: 90)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: next(clocks))
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: next(powers))
    with Utilisation(torch.device("cuda", 0), cores=1.0, period=0.01) as u:
        while len(u.samples) < 6:
            time.sleep(0.005)
    n = len(u.samples)
    got = u.result()
    assert got["gpu_util"] == pytest.approx(0.9)
    assert got["gpu_clock_mhz"] == pytest.approx(sum(([1980, 1980, 1755] * n)[:n]) / n)
    assert got["gpu_power_w"] == pytest.approx(sum(([500.0, 700.0] * n)[:n]) / n)


def test_a_gpu_that_does_not_report_its_clock_or_power_keeps_its_utilisation(monkeypatch):
    def not_supported(device=None):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: 40)
    monkeypatch.setattr(torch.cuda, "clock_rate", not_supported)
    monkeypatch.setattr(torch.cuda, "power_draw", not_supported)
    with Utilisation(torch.device("cuda", 0), cores=1.0, period=10.0) as u:
        pass
    got = u.result()
    assert (got["gpu_util"], got["gpu_clock_mhz"], got["gpu_power_w"]) == (pytest.approx(0.4), None, None)
