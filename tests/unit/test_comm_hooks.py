"""The counting all-reduce hook: bytes per step equal the gradient payload, and training is unchanged."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainscale.runtime import comm_hooks
from trainscale.runtime.comm_hooks import CommStats, HookState, counting_allreduce_hook, register_hook


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
    assert set(stats.per_step().values()) == {None}
    stats.record(100, last_bucket=False)
    stats.record(60, last_bucket=True)
    stats.record(160, last_bucket=True, calls=2)
    stats.exchange_seconds, stats.comm_seconds, stats.hidden_seconds = 0.5, 0.8, 0.4
    assert stats.per_step() == {
        "bytes_sent_per_step": 160.0,
        "allreduce_calls_per_step": 2.0,
        "comm_seconds_per_step": 0.25,
        "comm_ms_per_step": 400.0,
        "hidden_ms_per_step": 200.0,
    }
    total = CommStats()
    total.add(stats)
    stats.reset()
    assert (
        total.bytes_sent,
        total.steps,
        total.exchange_seconds,
        total.hidden_seconds,
        stats.steps,
        stats.exchange_seconds,
        stats.hidden_seconds,
    ) == (320, 2, 0.5, 0.4, 0, 0.0, 0.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlap_clock_splits_held_up_in_flight_and_hidden_time(monkeypatch):
    """Step 1: bucket A's hook runs 0-0.05 and launches a collective at 0.04 that lands at 0.8, during
    backward; the last bucket's hook runs 1.0-1.05, its collective lands at 1.5. Held up: 0.1 inside
    hooks + 0.45 tail; in flight 0.76 + 0.46; hidden: A's flight outside the hook, 0.05-0.8. Step 2: a
    blocking hook (collective 3.1-3.3 inside a 3.0-3.4 call): 0.4 held up, nothing hidden. Then a
    collective outside any hook: only in flight (its caller times how long it held the step up)."""
    fake = FakeClock()
    monkeypatch.setattr(comm_hooks.time, "perf_counter", fake)
    stats = CommStats()
    clock = comm_hooks.OverlapClock(stats)

    def at(t: float) -> None:
        fake.now = t

    a = clock.hook_called(last_bucket=False)
    at(0.04), (launched_a := clock.launched()), at(0.05), clock.hook_returned(a, last_bucket=False)
    at(0.8), clock.landed(launched_a), clock.hook_done()
    at(1.0), (b := clock.hook_called(last_bucket=True))
    at(1.04), (launched_b := clock.launched()), at(1.05), clock.hook_returned(b, last_bucket=True)
    assert stats.exchange_seconds == 0.0  # the step is still open
    at(1.5), clock.landed(launched_b), clock.hook_done()
    assert stats.exchange_seconds == pytest.approx(0.1 + 0.45)
    assert stats.comm_seconds == pytest.approx(0.76 + 0.46)
    assert stats.hidden_seconds == pytest.approx(0.75)
    at(3.0), (c := clock.hook_called(last_bucket=True))
    at(3.1), (launched_c := clock.launched()), at(3.3), clock.landed(launched_c)
    at(3.4), clock.hook_returned(c, last_bucket=True), clock.hook_done()
    assert stats.exchange_seconds == pytest.approx(0.55 + 0.4)
    assert (stats.comm_seconds, stats.hidden_seconds) == pytest.approx((1.22 + 0.2, 0.75))
    at(5.0), (launched_d := clock.launched()), at(5.5), clock.landed(launched_d)
    assert (stats.exchange_seconds, stats.comm_seconds) == pytest.approx((0.95, 1.92))


def test_interval_arithmetic():
    assert comm_hooks.merged([(2, 3), (0, 1), (0.5, 2.5), (4, 4)]) == [(0, 3)]
    assert comm_hooks.minus([(0, 10)], [(1, 2), (5, 20)]) == [(0, 1), (2, 5)]
    assert comm_hooks.measure([(0, 1), (0.5, 2), (3, 4)]) == 3


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
