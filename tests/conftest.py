"""Shared fixtures. ``cifar10_dir``: the real CIFAR-10 that TRAINSCALE_DATA points to. Tests marked ``gpu``
are skipped, with the reason, where torch sees no CUDA device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cifar10_dir() -> Path:
    """Path of the real CIFAR-10 (a batches folder or its parent) from $TRAINSCALE_DATA.

    Unset: the test is skipped, except under CI=true where a missing data set is a failure.
    """
    value = os.environ.get("TRAINSCALE_DATA", "")
    if not value:
        message = (
            "TRAINSCALE_DATA is not set: point it at the real CIFAR-10 (e.g. "
            "../shared/data/cifar-10-batches-bin) to run the real-data tests"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: real-data tests must run in CI)")
        pytest.skip(message)
    path = Path(value).expanduser()
    if not path.exists():
        pytest.fail(f"TRAINSCALE_DATA={value} does not exist")
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
