"""A shard's update rules, in one process (no RPC): the servers' futures are completed by pushes."""

import threading

import pytest
import torch

from trainscale.modes.ps.coordinator import CollectiveError, Coordinator
from trainscale.modes.ps.membership import Membership
from trainscale.modes.ps.server import Rule, ShardServer, staleness_scale
from trainscale.modes.ps.stats import epoch_row, merge_server_stats


def shard(rule: Rule, workers: int = 2, numel: int = 4) -> tuple[ShardServer, Membership]:
    members = Membership(workers)
    server = ShardServer(0, members)
    server.initialize(torch.zeros(numel), rule)
    return server, members


def test_async_push_is_the_sgd_step_and_counts_staleness():
    server, _ = shard(Rule("async", momentum=0.9, nesterov=True, weight_decay=1e-4))
    twin = torch.zeros(4)
    opt = torch.optim.SGD([twin], lr=0.0, momentum=0.9, nesterov=True, weight_decay=1e-4)
    for step, lr in enumerate([0.1, 0.05, 0.2]):
        grad = torch.arange(4.0) + step
        server.push(0, 0, step, grad, lr, read_version=0, active=None)
        twin.grad, opt.param_groups[0]["lr"] = grad, lr
        opt.step()
    params, version, _ = server.pull(0, 0, None, None).wait()
    assert torch.equal(params, twin) and version == 3
    stats = server.take_stats()
    assert stats["staleness_hist"] == {0: 1, 1: 1, 2: 1} and stats["staleness_max"] == 2
    state = server.state()
    assert state["version"] == 3 and torch.equal(state["momentum"], opt.state[twin]["momentum_buffer"])


def test_staleness_scale_is_one_over_one_plus_the_updates_in_between():
    assert [staleness_scale(s) for s in (0, 1, 2, 3, 9)] == [1.0, 0.5, 1 / 3, 0.25, 0.1]
    assert staleness_scale(-1) == 1.0  # never amplifies


def test_staleness_aware_push_scales_the_gradient_not_the_momentum_or_the_decay():
    server, _ = shard(Rule("async", momentum=0.4, weight_decay=1e-2, staleness_lr=True))
    twin = torch.zeros(4)
    opt = torch.optim.SGD([twin], lr=0.0, momentum=0.4, weight_decay=1e-2)
    for step, lr in enumerate([0.1, 0.05, 0.2]):  # all read version 0: staleness 0, 1, 2
        grad = torch.arange(4.0) + 1 + step
        server.push(step % 2, 0, step, grad, lr, read_version=0, active=None)
        twin.grad, opt.param_groups[0]["lr"] = grad / (1 + step), lr  # lr / (1 + staleness) on this gradient only
        opt.step()
    params, version, _ = server.pull(0, 0, None, None).wait()
    assert version == 3 and torch.allclose(params, twin, rtol=1e-6, atol=1e-7)
    assert server.take_stats()["staleness_hist"] == {0: 1, 1: 1, 2: 1}


def test_bounded_staleness_holds_the_fast_worker_until_the_slow_one_pushes():
    server, _ = shard(Rule("async", staleness=1))
    for step in range(2):  # worker 0 pushes twice, worker 1 not at all: 2 ahead
        server.push(0, 0, step, torch.ones(4), 0.1, server.version, None)
    held = server.pull(0, 0, 2, None)
    assert not held.done()
    assert server.pull(1, 0, 0, None).done()  # the slow worker is never held
    server.push(1, 0, 0, torch.ones(4), 0.1, 0, None)  # now 2 - 1 = 1 <= K
    assert held.done()
    assert server.take_stats()["clock_gap_max"] == 1


def test_bounded_staleness_does_not_wait_for_a_dead_worker_or_an_idle_one():
    server, members = shard(Rule("async", staleness=0))
    server.push(0, 0, 0, torch.ones(4), 0.1, 0, None)
    held = server.pull(0, 0, 1, None)
    assert not held.done()
    members.mark_dead(1, "test")
    assert held.done()
    warm, _ = shard(Rule("async", staleness=0))  # warm-start epoch: only worker 0 is active
    warm.push(0, 0, 0, torch.ones(4), 0.1, 0, (0,))
    assert warm.pull(0, 0, 1, (0,)).done()


def test_ps_sync_applies_the_mean_once_every_live_worker_pushed():
    server, members = shard(Rule("ps-sync"), workers=3)
    server.push(0, 0, 0, torch.full((4,), 1.0), 1.0, 0, None)
    pull = server.pull(0, 0, 1, None)
    server.push(1, 0, 0, torch.full((4,), 2.0), 1.0, 0, None)
    assert not pull.done() and server.version == 0
    members.mark_dead(2, "test")  # the round closes without the dead worker's push
    params, version, _ = pull.wait()
    assert version == 1 and torch.allclose(params, torch.full((4,), -1.5))


def test_model_averaging_adds_the_mean_change():
    server, _ = shard(Rule("ma"))
    server.push(0, 0, 0, torch.full((4,), 1.0), 0.1, 0, None)
    server.push(1, 0, 0, torch.full((4,), 3.0), 0.1, 0, None)
    params, version, _ = server.pull(1, 0, 1, None).wait()
    assert version == 1 and torch.equal(params, torch.full((4,), 2.0))


def test_pushes_from_many_threads_are_applied_atomically():
    server, _ = shard(Rule("async"), workers=4, numel=10_000)
    threads = [
        threading.Thread(target=lambda w=w: [server.push(w, 0, s, torch.ones(10_000), 1.0, 0, None) for s in range(50)])
        for w in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    params, version, _ = server.pull(0, 0, None, None).wait()
    assert version == 200 and torch.equal(params, torch.full((10_000,), -200.0))


def test_resume_refuses_a_state_of_another_size():
    server, _ = shard(Rule("async"))
    with pytest.raises(ValueError, match="same --servers"):
        server.load_state({"params": torch.zeros(5), "version": 1, "momentum": None})


def test_coordinator_reduces_over_live_workers_and_names_a_dead_broadcast_source():
    members = Membership(3)
    coord = Coordinator(members)
    a = coord.contribute(0, 1, "sum", torch.tensor([1.0]))
    b = coord.contribute(1, 1, "sum", torch.tensor([2.0]))
    assert not a.done()
    members.mark_dead(2, "test")
    assert a.wait().item() == b.wait().item() == 3.0
    c = coord.contribute(0, 2, "broadcast", None, src=2)
    d = coord.contribute(1, 2, "broadcast", None, src=2)
    for fut in (c, d):
        with pytest.raises(CollectiveError, match="source worker 2 died"):
            fut.wait()
    mismatch = coord.contribute(0, 3, "barrier", None)
    with pytest.raises(CollectiveError, match="out of step"):
        coord.contribute(1, 3, "max", torch.zeros(1)).wait()
    assert not mismatch.done()


def test_shard_statistics_merge_and_become_an_epoch_row():
    a = {
        "updates": 4,
        "pushes": 4,
        "staleness_sum": 2,
        "staleness_max": 1,
        "staleness_hist": {0: 2, 1: 2},
        "clock_gap_max": 1,
        "update_seconds": 0.4,
        "bytes_in": 16,
        "bytes_out": 16,
        "dead_workers": [],
    }
    b = dict(a, staleness_max=3, staleness_hist={3: 4}, staleness_sum=12, dead_workers=[1])
    merged = merge_server_stats([a, b])
    assert merged["staleness_hist"] == {0: 2, 1: 2, 3: 4} and merged["dead_workers"] == [1]
    row = epoch_row(
        merged,
        {"steps": 4, "push_seconds": 1, "pull_seconds": 1, "wait_seconds": 0, "bytes_pushed": 64, "bytes_pulled": 64},
        epoch_seconds=2.0,
        servers=2,
    )
    assert row["ps_pushes"] == 4 and row["pushes_per_sec"] == 2.0 and row["staleness_mean"] == 14 / 8
    assert row["bytes_pushed_per_step"] == 16


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.25}), ("randomk", {"ratio": 0.25, "seed": 3})])
def test_compressed_pushes_are_decoded_by_the_shard_with_error_feedback(name, params):
    from trainscale.modes.ps.codec import CodecSpec, PushCodec

    spec = CodecSpec(name, params)
    server, _ = shard(Rule("ma", codec=spec), numel=16)
    codec = PushCodec(spec, error_feedback=True)
    grad = torch.linspace(-1, 1, 16)
    (payload,) = codec.encode([grad], epoch=0)
    assert all(not isinstance(v, torch.Tensor) for v in payload.meta.values())  # caches stay home
    assert payload.nbytes < grad.numel() * 4
    server.push(0, 0, 0, payload, 1.0, 0, (0,))
    params_after, _, _ = server.pull(0, 0, 1, (0,)).wait()
    # What the shard applied plus what the worker kept back is exactly the gradient (error feedback).
    assert torch.allclose(params_after + codec.feedback.residual("shard0"), grad)
    assert server.take_stats()["bytes_in"] == payload.nbytes
