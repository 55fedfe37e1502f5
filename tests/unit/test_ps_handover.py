"""A dead parameter-server worker's batches handed to the live ones (handover.py), in one process."""

import pytest
import torch

from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.modes.ps.client import Dropped, dropped, raised
from trainscale.modes.ps.coordinator import Coordinator
from trainscale.modes.ps.handover import HandOver, Ledger, Plan, owner_view
from trainscale.modes.ps.membership import Membership, WorkerDropped


def test_a_plan_deals_orphans_round_robin_and_says_who_trains_each_extra_step():
    plan = Plan(0, 9, live=(0, 2, 3), orphans=tuple((1, b) for b in range(7)))
    assert plan.mine(0) == [(1, 0), (1, 3), (1, 6)]
    assert plan.mine(2) == [(1, 1), (1, 4)] and plan.mine(3) == [(1, 2), (1, 5)]
    assert plan.mine(1) == []  # a dead worker gets nothing
    assert [plan.active_at(k) for k in range(4)] == [(0, 2, 3), (0, 2, 3), (0,), ()]
    dealt = sorted(b for w in plan.live for b in plan.mine(w))
    assert dealt == sorted(plan.orphans)  # every orphan exactly once


def test_the_ledger_hands_over_only_what_no_push_committed():
    ledger = Ledger()
    ledger.commit(2, [(1, 0), (1, 1), (0, 0)])
    ledger.commit(2, [(1, 3)])
    ledger.commit(1, [(2, 0)])  # another epoch does not count
    plan = ledger.plan(2, 5, base_step=7, live=[3, 0], dead=[2, 1])
    assert plan.live == (0, 3) and plan.base_step == 7
    assert plan.orphans == ((1, 2), (1, 4), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4))
    assert ledger.committed(2) == 4 and ledger.committed(1) == 1
    ledger.commit(2, plan.orphans)
    assert ledger.plan(2, 5, 9, [0, 3], [1, 2]).orphans == ()


def test_the_plan_collective_waits_for_every_worker_or_its_death():
    members = Membership(3)
    coordinator = Coordinator(members)
    coordinator.ledger.commit(0, [(2, 0)])
    a = coordinator.contribute(0, 1, "plan", (0, 2, 5))
    b = coordinator.contribute(1, 1, "plan", (0, 2, 6))
    assert not a.done()  # worker 2 is neither here nor known dead: it may still push
    members.mark_dead(2, "test")
    plan = a.wait()
    assert plan == b.wait() and plan.live == (0, 1) and plan.base_step == 6 and plan.orphans == ((2, 1),)


def test_a_worker_declared_dead_is_turned_away():
    members = Membership(2)
    coordinator = Coordinator(members)
    members.mark_dead(1, "ping timed out")
    with pytest.raises(WorkerDropped, match="worker 1 was dropped"):
        coordinator.contribute(1, 1, "barrier", None).wait()


class FakeClient:
    def __init__(self, worker):
        self.worker, self.step, self.active, self.covers = worker, 4, "epoch's", []


class FakeOptimizer:
    def __init__(self):
        self.holding, self.flushes = False, []

    def flush(self, active):
        self.flushes.append(active)


def device_batches(rank: int, world: int = 3) -> DeviceBatches:
    return DeviceBatches(
        synthetic_dataset(96, 8, seed=1),
        8,
        train=True,
        augment=AugmentConfig(),
        device="cpu",
        rank=rank,
        world_size=world,
        seed=5,
    )


def test_a_worker_trains_its_share_as_the_owner_would_have_then_asks_again():
    plans = [Plan(1, 6, (0, 2), ((1, 0), (1, 1), (1, 2))), Plan(1, 8, (0, 2), ())]
    asked = []

    def ask(epoch, batches, step):
        asked.append((epoch, batches, step))
        return plans[len(asked) - 1]

    client, optimizer = FakeClient(2), FakeOptimizer()
    handover = HandOver(2, device_batches(2), client, ask, optimizer)
    tail = handover.tail(1)
    images, labels = next(tail)
    assert client.step == 6 and client.active == (0, 2) and client.covers == [(1, 1)]
    assert optimizer.holding  # ma does not average in the middle of a share
    owners = list(device_batches(1).epoch(1))
    assert torch.equal(images, owners[1][0]) and torch.equal(labels, owners[1][1])
    assert list(tail) == []
    assert asked == [(1, 4, 4), (1, 4, 6)] and optimizer.flushes == [None, (0, 2)]
    assert handover.trained == 1 and client.active is None and not optimizer.holding


def test_an_owner_view_is_the_owners_shard_without_a_copy_of_the_data():
    view = owner_view(device_batches(0), 2)
    for (a, la), (b, lb) in zip(view.epoch(3), device_batches(2).epoch(3)):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_dropped_answer_becomes_one_dropped_error_however_it_arrives():
    """A handler run with async_execution whose Future failed answers with the exception object itself."""
    answer = WorkerDropped("worker 2 was dropped from the job (ping failed)")
    with pytest.raises(WorkerDropped) as caught:
        raised(answer)
    assert isinstance(dropped(caught.value), Dropped)
    assert isinstance(dropped(RuntimeError("On worker0: WorkerDropped: worker 2 was dropped")), Dropped)
    assert dropped(RuntimeError("EOF")) is None and raised(3) == 3


def test_the_handlers_answer_a_dropped_worker_with_the_error_rather_than_raise_it():
    """Raised in a handler, it would reach the worker as a remote traceback; answered, ``raised`` makes it one line."""
    from trainscale.modes.ps import handlers
    from trainscale.modes.ps.server import Rule, ShardServer

    members = Membership(2)
    shard = ShardServer(0, members)
    shard.initialize(torch.zeros(3), Rule("async"))
    handlers.install(shard, members, Coordinator(members))
    try:
        members.mark_dead(1, "ping timed out")
        answer = handlers.push(1, 0, 0, torch.ones(3), 0.1, 0, None, ((1, 0),))
        assert isinstance(answer, WorkerDropped) and shard.version == 0
        assert handlers._coordinator.ledger.committed(0) == 0  # nothing of it committed
        with pytest.raises(WorkerDropped):
            members.refused(1).wait()
    finally:
        handlers.uninstall()
