"""The collective helpers: no-ops for a process that is alone, an error for one that should be in a group."""

import pytest
import torch

from trainscale.runtime import all_reduce_sum, barrier, broadcast_object, is_main_process, rank, world_size
from trainscale.runtime.dist import NoProcessGroup


def test_helpers_are_no_ops_at_world_size_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    values = torch.tensor([1.0, 2.0])
    assert torch.equal(all_reduce_sum(values), values)
    assert (rank(), world_size(), is_main_process(), broadcast_object("x")) == (0, 1, True, "x")
    barrier()


@pytest.mark.parametrize("call", [lambda: all_reduce_sum(torch.ones(1)), world_size, rank, barrier,
                                  lambda: broadcast_object(1), is_main_process])
def test_helpers_raise_when_the_launcher_says_distributed_but_no_group_exists(monkeypatch, call):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(NoProcessGroup, match="WORLD_SIZE=4 says this process is one of 4"):
        call()
