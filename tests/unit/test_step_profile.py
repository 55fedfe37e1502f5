"""``benchmarks/step_profile.py``'s pure parts: the GPU's busy time is the union of its kernels' intervals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "step_profile", Path(__file__).parents[2] / "benchmarks" / "step_profile.py"
)
assert SPEC is not None and SPEC.loader is not None
step_profile = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(step_profile)


def test_busy_time_counts_overlapping_kernels_once_and_gaps_not_at_all() -> None:
    kernels = [(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (21.0, 22.0)]  # microseconds, unsorted overlaps
    assert step_profile.busy_seconds(kernels) == pytest.approx(17e-6)
    assert step_profile.busy_seconds([]) == 0.0


def test_the_profiled_epoch_must_be_one_the_run_has() -> None:
    with pytest.raises(SystemExit):
        step_profile.parse_args(["--epochs", "2", "--profile-epoch", "3"])
