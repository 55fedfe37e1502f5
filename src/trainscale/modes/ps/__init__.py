"""Asynchronous and synchronous SGD through a sharded parameter server, on torch.distributed.rpc.

Modes of `trainscale train` (registered on import): ``async`` (ASGD, optionally bounded staleness
``--staleness K``), ``ps-sync`` (BSP through the servers, like ps-lite's dist_sync) and ``ma``
(periodic model averaging, ``--average-every STEPS``), with ``--servers S`` shards per node beside
``--workers N``. Pieces: ``shards`` (the flat vector and its cut), ``server`` (a shard's state and
rules, one lock per read-modify-write), ``membership`` (dead-worker detection), ``coordinator`` (the
workers' collectives), ``client`` (a worker's push/pull), ``optimizer`` (what ``train_one_epoch``
steps), ``batches`` (warm start, whole-test-set evaluation), ``supervisor`` (a worker may die without
ending the job) and ``mode`` (roles by rank, the trainer's hooks, the statistics).

Transport: torch.distributed.rpc (TensorPipe), chosen after measuring (``benchmarks/ps_transport.py``,
one worker and one server process on the 2-core development VM, push + pull round trip, 20-30
repeats, three runs): ResNet-32's 1.86 MB: RPC 2.1-2.5 ms, gloo send/recv 1.7-2.1 ms; ResNet9's 26.3 MB:
RPC 23-30 ms, gloo 20-21 ms. Gloo moves bytes 0-30% faster, but at ResNet-32's size the gap (under
1 ms) is under 0.3% of a 330 ms CPU training step, while RPC gives what a parameter server needs and
point-to-point gloo does not: handlers any worker may call at any time (gloo needs a posted receive per
expected message and hand-made request/response matching), a future and a timeout per call, failures
confined to the calls to the dead peer (an immediate EOF) instead of a group, and
``@rpc.functions.async_execution`` so waits (the staleness bound, BSP rounds, the workers'
collectives) hold no thread. For large models on fast links a gloo data plane under the RPC control
plane would recover the difference.

Public pieces for running a server or a worker outside ``trainscale train`` (as ``benchmarks/ps_overhead.py`` does):
``serve`` (a server's life), ``installed_collectives`` with ``RpcCollectives`` (a worker's collectives over RPC),
``ShardClient`` (push/pull) and ``PSOptimizer`` with ``rule_from`` and ``EpochClock`` (a worker's step).
"""

from trainscale.modes.ps.client import RpcCollectives, ShardClient
from trainscale.modes.ps.config import DEFAULT_AVERAGE_EVERY, PSConfig
from trainscale.modes.ps.mode import (  # noqa: F401  (registers)
    PS_MODES,
    ParameterServerMode,
    Role,
    installed_collectives,
    role_from_env,
    serve,
)
from trainscale.modes.ps.optimizer import EpochClock, PSOptimizer, rule_from

__all__ = [
    "DEFAULT_AVERAGE_EVERY",
    "PS_MODES",
    "EpochClock",
    "PSConfig",
    "PSOptimizer",
    "ParameterServerMode",
    "Role",
    "RpcCollectives",
    "ShardClient",
    "installed_collectives",
    "role_from_env",
    "rule_from",
    "serve",
]
