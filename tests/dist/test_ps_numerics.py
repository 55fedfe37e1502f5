"""The parameter server changes where the update happens, not what it computes.

Real processes and real RPC (no launcher, to keep it fast): one worker process and S server processes.
With one server and one worker, ASGD through the server must equal local SGD step for step (same
momentum, weight decay and per-step LR, fp32); and parameters and server state must come back from
1, 2 and 3 shards exactly as they were sent (the same three server processes serve as 1, 2 and 3
shards in turn).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from trainscale.runtime.network import free_port

STEPS = 12
LRS = [0.05 * (1 + (i % 4)) / 4 for i in range(STEPS)]  # the LR changes every step, like a schedule


def _env(port: int, rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def _server(port: int, index: int, servers: int) -> None:
    from trainscale.modes.config import TrainConfig
    from trainscale.modes.ps.mode import Role, serve

    _env(port, 1 + index, 1 + servers)
    cfg = TrainConfig.flat(threads=1, rpc_timeout=60.0, heartbeat_timeout=10.0)
    serve(cfg, Role("server", index, 1, servers, 1 + index, 1 + servers))


def _worker(port: int, servers: int, job: str, queue) -> None:
    from trainscale.modes.ps.client import RpcCollectives, ShardClient
    from trainscale.modes.ps.mode import installed_collectives
    from trainscale.runtime.process_group import rpc_session

    _env(port, 0, 1 + servers)
    with rpc_session("worker0", 0, 1 + servers, 60.0):
        with installed_collectives(RpcCollectives(0, 1)):
            if job == "sgd":
                queue.put(_compare_with_local(ShardClient(0, servers, numel=_numel(), timeout_s=60.0)))
            else:  # the same server processes, used as 1, 2 and 3 shards
                queue.put(
                    {n: _round_trip(ShardClient(0, n, numel=_numel(), timeout_s=60.0)) for n in range(1, servers + 1)}
                )
            ShardClient(0, servers, numel=_numel(), timeout_s=60.0).leave()


def _model() -> torch.nn.Module:
    from trainscale.models import create_model

    torch.manual_seed(3)
    return create_model("mlp", hidden=(64, 32))


def _numel() -> int:
    return sum(p.numel() for p in _model().parameters())


def _compare_with_local(client) -> list[float]:
    """Max |difference| of the parameters after each step: PS worker vs a local SGD twin."""
    from trainscale.modes.ps.optimizer import EpochClock, PSOptimizer, rule_from
    from trainscale.modes.ps.shards import flatten

    ps_model, local_model = _model(), _model()
    hyper = dict(lr=0.0, momentum=0.9, weight_decay=5e-4, nesterov=True)
    ps_opt = torch.optim.SGD(ps_model.parameters(), **hyper)
    ps_opt = PSOptimizer(ps_opt, client, rule_from(ps_opt, "async", None), 1, EpochClock())
    ps_opt.start()
    local_opt = torch.optim.SGD(local_model.parameters(), **hyper)
    gen = torch.Generator().manual_seed(5)
    diffs = []
    for step in range(STEPS):
        x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        for model, opt in ((ps_model, ps_opt), (local_model, local_opt)):
            for group in opt.param_groups:
                group["lr"] = LRS[step]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        diffs.append((flatten(ps_model.parameters()) - flatten(local_model.parameters())).abs().max().item())
    return diffs


def _round_trip(client) -> dict[str, bool]:
    """Initial parameters, then a server state with momentum and a version clock, through the shards."""
    from trainscale.modes.ps.server import Rule

    sent = torch.randn(_numel(), generator=torch.Generator().manual_seed(1))
    client.initialize(sent, Rule("async", momentum=0.9))
    back = client.pull(wait=False)
    state = client.fetch_state()
    changed = [
        {"params": s["params"] + 1, "version": 7 + i, "momentum": torch.full_like(s["params"], 0.5)}
        for i, s in enumerate(state)
    ]
    client.restore(changed)
    again = client.fetch_state()
    return {
        "params": torch.equal(back, sent),
        "bounds": [s["params"].numel() for s in state] == [b - a for a, b in client.bounds],
        "state": all(
            torch.equal(a["params"], b["params"])
            and torch.equal(a["momentum"], b["momentum"])
            and a["version"] == b["version"]
            for a, b in zip(changed, again)
        ),
    }


def _run(servers: int, job: str):
    ctx = mp.get_context("spawn")
    port, queue = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_server, args=(port, s, servers)) for s in range(servers)]
    procs.append(ctx.Process(target=_worker, args=(port, servers, job, queue)))
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0] * len(procs)


@pytest.mark.dist
def test_one_server_one_worker_async_equals_local_sgd_step_for_step():
    diffs = _run(1, "sgd")
    assert len(diffs) == STEPS
    assert max(diffs) <= 1e-6, diffs  # the same fp32 arithmetic, element by element
    print("max |PS - local| per step:", diffs)


@pytest.mark.dist
def test_parameters_and_state_round_trip_through_1_2_and_3_shards():
    ok = {"params": True, "bounds": True, "state": True}
    assert _run(3, "trip") == {1: ok, 2: ok, 3: ok}
