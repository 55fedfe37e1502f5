"""How busy the device was while a worker trained, as the MXNet results page reports it beside throughput
("6800 (8-80%)": 8 GPUs at 80%).

CPU: the worker process's CPU time (every thread, from the OS) over the wall time of the pass, divided by the
cores it may use: its torch threads, or on an emulated cluster its share of the host's CPU quota. GPU: NVML's
utilisation of the worker's device, its SM clock and its power draw, sampled every ``period`` seconds by a
background thread (None, with one warning, where NVML cannot be read: torch reads it through ``pynvml``, which the
``nvidia-ml-py`` dependency brings; the clock or power alone is None on a GPU that does not report it). The clock
and power say whether a slower epoch ran on a throttled GPU (power or temperature capping lowers the clock). All
are per worker; the trainer records the mean over workers per epoch.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("trainscale.train")


def allowed_cores(facts: dict[str, Any] | None, processes_per_host: int) -> float:
    """The cores this worker may keep busy: its threads, capped by its share of an emulated host's quota."""
    threads = float(torch.get_num_threads())
    quota = (facts or {}).get("cpus_per_host")
    return min(threads, quota / max(1, processes_per_host)) if quota else threads


class Utilisation:
    """Context manager around one training pass; ``result()`` gives ``cpu_util`` and ``gpu_util`` (0-1),
    ``gpu_clock_mhz`` and ``gpu_power_w``."""

    def __init__(self, device: torch.device, cores: float, period: float = 0.5) -> None:
        self.device, self.cores, self.period = device, cores, period
        self.samples: list[tuple[float, float | None, float | None]] = []  # utilisation, clock MHz, power W
        self.cpu = self.wall = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Utilisation:
        self._start = (time.process_time(), time.perf_counter())
        if self.device.type == "cuda" and _nvml_works(self.device):
            self._thread = threading.Thread(target=self._sample, name="trainscale-nvml", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = time.process_time() - self._start[0]
        self.wall = time.perf_counter() - self._start[1]
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if not self.samples:  # a pass shorter than the period: NVML's own window still covers its end
                self.samples.append(gpu_reading(self.device))

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(gpu_reading(self.device))

    def result(self) -> dict[str, float | None]:
        cpu = self.cpu / (self.wall * self.cores) if self.wall > 0 and self.cores > 0 else None
        util, clock, power = (_mean([s[i] for s in self.samples]) for i in range(3))
        return {"cpu_util": cpu, "gpu_util": util, "gpu_clock_mhz": clock, "gpu_power_w": power}


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def gpu_reading(device: torch.device) -> tuple[float, float | None, float | None]:
    """NVML's utilisation (0-1), SM clock (MHz) and power draw (W) of ``device``; the clock or power is None where
    the GPU does not report it."""
    clock = _reported(torch.cuda.clock_rate, device, 1.0)
    return torch.cuda.utilization(device) / 100.0, clock, _reported(torch.cuda.power_draw, device, 1e-3)


def _reported(read: Callable[[torch.device], int], device: torch.device, scale: float) -> float | None:
    try:
        return read(device) * scale
    except Exception:  # NVML_ERROR_NOT_SUPPORTED and the like: the figure is missing, never the run
        return None


def _nvml_works(device: torch.device) -> bool:
    try:
        torch.cuda.utilization(device)
    except Exception as exc:  # pynvml missing or NVML unavailable: no GPU figure, never a failed run
        _warn_once(f"{type(exc).__name__}: {exc}")
        return False
    return True


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("no GPU utilisation figures: NVML cannot be read (%s); pip install nvidia-ml-py", reason)
