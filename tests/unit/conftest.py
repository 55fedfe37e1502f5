"""Fixtures shared by the unit tests."""

import pytest
import torch

from trainscale.runtime.network import free_port
from trainscale.runtime.process_group import process_group


@pytest.fixture
def world_of_one(monkeypatch):
    """A real gloo process group of one rank (through trainscale's only group factory)."""
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with process_group(torch.device("cpu"), "gloo", timeout_s=30):
        yield
