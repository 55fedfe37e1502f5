"""The counting all-reduce hook: bytes per step equal the gradient payload, and training is unchanged."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainscale.runtime import comm_hooks
from trainscale.runtime.comm_hooks import CommStats, HookState, counting_allreduce_hook, register_hook
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
    assert stats.per_step() == {"bytes_sent_per_step": None, "allreduce_calls_per_step": None,
                                "comm_seconds_per_step": None}
    stats.record(100, last_bucket=False)
    stats.record(60, last_bucket=True)
    stats.record(160, last_bucket=True, calls=2)
    stats.exchange_seconds = 0.5
    assert stats.per_step() == {"bytes_sent_per_step": 160.0, "allreduce_calls_per_step": 2.0,
                                "comm_seconds_per_step": 0.25}
    total = CommStats()
    total.add(stats)
    stats.reset()
    assert (total.bytes_sent, total.steps, total.exchange_seconds, stats.steps, stats.exchange_seconds) == \
        (320, 2, 0.5, 0, 0.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_exchange_clock_counts_blocking_calls_and_the_tail_after_the_last_bucket(monkeypatch):
    """Step 1: two overlapped buckets, the last handed over at t=1 and the collectives done at t=1.5 and
    1.25: 0.5 s exposed, plus 0.1 s spent inside the calls. Step 2: a blocking hook whose future is
    already done when it returns: only its 0.3 s inside the call."""
    fake = FakeClock()
    monkeypatch.setattr(comm_hooks.time, "perf_counter", fake)
    stats, clock = CommStats(), comm_hooks.ExchangeClock()
    clock.returned(stats, 0.05, last_bucket=False)
    fake.now = 1.0
    clock.returned(stats, 0.05, last_bucket=True)
    fake.now = 1.5
    clock.completed(stats)
    assert stats.exchange_seconds == pytest.approx(0.1)  # one collective still pending
    fake.now = 1.25
    clock.completed(stats)
    assert stats.exchange_seconds == pytest.approx(0.6)
    fake.now = 3.0
    clock.returned(stats, 0.3, last_bucket=True)
    clock.completed(stats)
    assert stats.exchange_seconds == pytest.approx(0.9)


def test_a_slow_hook_is_counted_as_communication(world_of_one):
    def slow(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        time.sleep(0.02)
        return counting_allreduce_hook(state, bucket)

    ddp = DistributedDataParallel(model())
    state = HookState()
    register_hook(ddp, state, slow)
    train(ddp, steps=3)
    assert 0.02 <= state.stats.per_step()["comm_seconds_per_step"] < 0.5


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
