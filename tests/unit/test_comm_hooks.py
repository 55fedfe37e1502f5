"""The counting all-reduce hook: bytes per step equal the gradient payload, and training is unchanged."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainscale.runtime.comm_hooks import CommStats, HookState, register_hook
from trainscale.runtime.network import free_port
from trainscale.runtime.process_group import process_group


@pytest.fixture
def world_of_one(monkeypatch):
    """A real gloo process group of one rank (through trainscale's only group factory)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with process_group(torch.device("cpu"), "gloo", timeout_s=30):
        yield


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(net: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def test_commstats_per_step_and_reset():
    stats = CommStats()
    assert stats.per_step() == {"bytes_sent_per_step": None, "allreduce_calls_per_step": None}
    stats.record(100, last_bucket=False)
    stats.record(60, last_bucket=True)
    stats.record(160, last_bucket=True, calls=2)
    assert stats.per_step() == {"bytes_sent_per_step": 160.0, "allreduce_calls_per_step": 2.0}
    total = CommStats()
    total.add(stats)
    stats.reset()
    assert (total.bytes_sent, total.steps, stats.steps) == (320, 2, 0)


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.004])
def test_hook_counts_every_gradient_byte_once_per_step(world_of_one, bucket_cap_mb):
    net = model()
    params = sum(p.numel() for p in net.parameters())
    ddp = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
    state = HookState()
    register_hook(ddp, state)
    train(ddp, steps=3)
    assert state.stats.steps == 3
    assert state.stats.bytes_sent == 3 * 4 * params
    assert state.stats.calls >= 3 if bucket_cap_mb == 25 else state.stats.calls > 3


def test_hook_leaves_training_unchanged(world_of_one):
    plain, hooked = model(), model()
    train(plain, steps=4)
    ddp = DistributedDataParallel(hooked)
    register_hook(ddp, HookState())
    train(ddp, steps=4)
    for a, b in zip(plain.parameters(), hooked.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
