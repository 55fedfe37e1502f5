"""``benchmarks/step_profile.py``'s pure parts: the GPU's busy time is the union of its kernels' intervals; a
captured step's replay is attributed to its whole-step graph."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from torch.autograd import DeviceType

from tests.scripts import load_benchmark

step_profile = load_benchmark("step_profile")


def test_busy_time_counts_overlapping_kernels_once_and_gaps_not_at_all() -> None:
    kernels = [(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (21.0, 22.0)]  # microseconds, unsorted overlaps
    assert step_profile.busy_seconds(kernels) == pytest.approx(17e-6)
    assert step_profile.busy_seconds([]) == 0.0


def test_the_profiled_epochs_must_be_ones_the_run_has(capsys) -> None:
    cpu = ["--device", "cpu"]
    for argv in (["--epochs", "2", "--profile-epoch", "3"], ["--epochs", "4", "--profile-epoch", "3", "5"]):
        with pytest.raises(SystemExit):
            step_profile.parse_args([*cpu, *argv])
        assert "--profile-epoch" in capsys.readouterr().err
    assert step_profile.parse_args([*cpu, "--epochs", "6", "--profile-epoch", "3", "5"]).profile_epoch == [3, 5]
    assert step_profile.parse_args(cpu).profile_epoch == [3]


class Span:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end

    def elapsed_us(self) -> float:
        return self.end - self.start


class Event:
    def __init__(self, name: str, cuda: bool, start: float, end: float, device_us: float = 0.0) -> None:
        self.name, self.time_range, self.device_time_total = name, Span(start, end), device_us
        self.device_type = DeviceType.CUDA if cuda else DeviceType.CPU
        self.self_cpu_time_total = 0.0 if cuda else end - start


class Profile:
    def __init__(self, events: list[Event]) -> None:
        self._events = events

    def events(self) -> list[Event]:
        return self._events

    def key_averages(self) -> Any:
        return SimpleNamespace(table=lambda **_: "table")


def two_steps(events_at: Callable[[float], list[Event]]) -> dict[str, Any]:
    """``breakdown`` of two steps 1 ms apart, the events of the step starting at ``t`` us being ``events_at(t)``."""
    events = [e for step in range(2) for e in events_at(1000.0 * step)]
    return step_profile.breakdown(Profile(events), steps=2, seconds=0.002, top=5, cuda=True)


def graph_and_outside(graph_ms: float, outside_ms: float, ranges_ms: float | None = None) -> dict[str, Any]:
    ranges = {} if ranges_ms is None else {"whole-step graph's ranges on the GPU, first kernel to last": ranges_ms}
    return {
        "whole-step graph (with the batch's copies into it)": pytest.approx(graph_ms),
        **{k: pytest.approx(v) for k, v in ranges.items()},
        "kernels outside the compiled graphs": pytest.approx(outside_ms),
    }


def test_a_captured_steps_replay_is_its_whole_step_graph_and_the_rest_is_outside() -> None:
    """Two steps, each a marked replay whose kernels take 400 us, and one kernel of 100 us launched outside it."""
    found = two_steps(
        lambda t: [
            Event(step_profile.WHOLE_STEP, False, t, t + 50, device_us=400),
            Event("cudaGraphLaunch", False, t + 10, t + 20),
            Event("graph kernel", True, t + 100, t + 500),
            Event("cudaLaunchKernel", False, t + 600, t + 610),
            Event("lone kernel", True, t + 700, t + 800),
        ]
    )
    assert found["gpu_ms_per_step"] == graph_and_outside(0.4, 0.1)
    assert found["host_launches_per_step"] == 2
    assert found["gpu_busy_seconds"] == pytest.approx(1e-3)


def test_the_gpus_idle_time_is_split_into_the_epochs_ends_and_bands_of_gaps_between_kernels() -> None:
    """Host events span 0..1000 us; kernels leave 50 us idle at the start, gaps of 2, 3, 40 and 300 us between
    them (one overlap, which is no gap), and 100 us at the end."""
    kernels = [(50.0, 100.0), (102.0, 200.0), (150.0, 210.0), (213.0, 300.0), (340.0, 500.0), (800.0, 900.0)]
    idle = step_profile.kernel_gaps(kernels, 0.0, 1000.0, steps=2)
    assert idle["kernels_per_step"] == 3
    assert idle["idle_ms_before_first_kernel"] == pytest.approx(0.05)
    assert idle["idle_ms_after_last_kernel"] == pytest.approx(0.1)
    assert idle["gaps_per_step"] == {
        "under 10 us": {"count": 1.0, "ms": pytest.approx(0.0025)},
        "10-100 us": {"count": 0.5, "ms": pytest.approx(0.02)},
        "100 us or more": {"count": 0.5, "ms": pytest.approx(0.15)},
    }


class Annotation(Event):
    """A ``record_function`` range as kineto draws it on the GPU's timeline."""

    is_user_annotation = True

    def __init__(self, name: str, start: float, end: float) -> None:
        super().__init__(name, True, start, end)


def test_a_captured_steps_kernels_are_those_inside_its_marks_gpu_ranges_and_the_ranges_are_no_kernels() -> None:
    """Two steps, each a replay of two kernels (300 us in all) inside the mark's GPU range, and a lone kernel of
    100 us after it; the marks' CPU events see none of the graph's kernels (as with a real CUDA graph)."""
    found = two_steps(
        lambda t: [
            Event(step_profile.WHOLE_STEP, False, t, t + 50, device_us=5),
            Annotation(step_profile.WHOLE_STEP, t + 100, t + 420),
            Event("graph kernel", True, t + 100, t + 300),
            Event("graph kernel", True, t + 320, t + 420),
            Event("lone kernel", True, t + 700, t + 800),
        ]
    )
    assert found["gpu_ms_per_step"] == graph_and_outside(0.3, 0.1, ranges_ms=0.32)
    assert found["gpu_busy_seconds"] == pytest.approx(0.8e-3)
    assert found["gpu_idle"]["kernels_per_step"] == 3
    assert found["gpu_idle"]["gaps_per_step"]["10-100 us"] == {"count": 1.0, "ms": pytest.approx(0.02)}
