"""The parameter-server modes of `trainscale train`: ``async``, ``ps-sync`` and ``ma``.

Roles by rank, inside one job of the same launcher as sync mode (``trainscale train --workers N
--servers S``, or torchrun with ``--nproc-per-node N+S``): on every node, local ranks ``0..N-1`` are
workers and ``N..N+S-1`` are server shards; with ``--nnodes M`` there are ``N*M`` workers and ``S*M``
shards. Worker ``i`` of node ``g`` is worker ``g*N+i``; the run folder belongs to node 0's first worker.
Servers only answer RPCs; worker ranks supervise a child that trains (see ``supervisor.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from trainscale.compression.config import CompressionConfig
from trainscale.config import Section
from trainscale.data import Batches
from trainscale.errors import ConfigError
from trainscale.modes.base import SERVER, SUPERVISOR, Mode, Result, register_mode
from trainscale.modes.ps import handlers
from trainscale.modes.ps.batches import EmptyBatches, MainOnly, TrainBatches, unsharded
from trainscale.modes.ps.client import PSError, RpcCollectives, ShardClient
from trainscale.modes.ps.codec import PushCodec, codec_from_config
from trainscale.modes.ps.config import (
    DEFAULT_AVERAGE_EVERY,
    PS_MODES,
    PSConfig,
    parse_async_momentum,
    resolve_async_momentum,
    validate_ps,
)
from trainscale.modes.ps.coordinator import Coordinator
from trainscale.modes.ps.handover import HandOver
from trainscale.modes.ps.membership import Membership, server_name, worker_name
from trainscale.modes.ps.optimizer import EpochClock, PSOptimizer, injected_slowdown, rule_from
from trainscale.modes.ps.server import Rule, ShardServer
from trainscale.modes.ps.stats import WorkerStats, epoch_row, merge_server_stats
from trainscale.modes.ps.supervisor import supervise
from trainscale.record import K
from trainscale.runtime import dist as tsdist
from trainscale.runtime.cpus import threads_per_worker
from trainscale.runtime.dist import Collectives, restart_count
from trainscale.runtime.faults import FaultConfig, InjectedFault, injected_faults, not_yet_fired
from trainscale.runtime.ft import log_event
from trainscale.runtime.process_group import rpc_session, worker_device
from trainscale.train.callbacks import Writes

if TYPE_CHECKING:  # modes.config imports this package's section, whose package imports this module
    from trainscale.modes.config import TrainConfig

log = logging.getLogger("trainscale.ps")

BATCHNORM = (
    "BatchNorm running statistics stay local while training and are averaged over the live workers "
    "at each epoch end; they are not on the servers"
)
STOPPED_MARGIN_S = 2.0  # a stopped worker is killed this long after the servers may have dropped it
EVALUATION = (
    "main worker (node 0's lowest live worker), whole test set, on the servers' parameters after the epoch barrier"
)


@dataclass(frozen=True)
class Role:
    """This process's part in the job, from the launcher's environment."""

    kind: str  # "worker" or "server"
    index: int  # worker or server index over the whole job
    workers: int
    servers: int
    rank: int
    world: int

    @property
    def name(self) -> str:
        return worker_name(self.index) if self.kind == "worker" else server_name(self.index)


def role_from_env(workers_per_node: int, servers_per_node: int, env: Mapping[str, str] | None = None) -> Role:
    """Assign worker/server by local rank; a process count that does not match is a ConfigError."""
    env = os.environ if env is None else env
    world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    local = int(env.get("LOCAL_RANK", "0"))
    per_node = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if per_node != workers_per_node + servers_per_node or world % per_node:
        raise ConfigError(
            f"--workers {workers_per_node} --servers {servers_per_node} needs "
            f"{workers_per_node + servers_per_node} processes per node, but the launcher started "
            f"{per_node} (world size {world}); with torchrun pass --nproc-per-node "
            f"{workers_per_node + servers_per_node}"
        )
    node = int(env.get("GROUP_RANK", str(rank // per_node)))
    nodes = world // per_node
    if local < workers_per_node:
        index, kind = node * workers_per_node + local, "worker"
    else:
        index, kind = node * servers_per_node + local - workers_per_node, "server"
    return Role(kind, index, workers_per_node * nodes, servers_per_node * nodes, rank, world)


@contextlib.contextmanager
def installed_collectives(collectives: Collectives) -> Iterator[None]:
    tsdist.use_collectives(collectives)
    try:
        yield
    finally:
        tsdist.use_collectives(None)
        tsdist.set_main_rank(0)


@register_mode(*PS_MODES)
class ParameterServerMode(Mode):
    """``async``/``ps-sync``/``ma`` through sharded servers over torch RPC (see the package docstring)."""

    distributed = True
    # compression: the pushes, encoded on the worker (error feedback there) and decoded by the servers
    sections: ClassVar[tuple[type[Section], ...]] = (CompressionConfig, FaultConfig, PSConfig)
    uses_servers = True

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:  # type: ignore[override]
        validate_ps(cfg, cfg.ps, cfg.faults, cfg.compression)

    def __init__(self, name: str, cfg: TrainConfig) -> None:
        self.name = name
        self.cfg = cfg
        self._role: Role | None = None
        self.clock = EpochClock()
        self.client: ShardClient | None = None
        self.optimizer: PSOptimizer | None = None
        self.batches: TrainBatches | None = None
        self.collectives: RpcCollectives | None = None
        self.handover: HandOver | None = None
        self.totals: dict[str, Any] = {
            "server": merge_server_stats([]),
            "seconds": 0.0,
            "worker_samples": None,
            "worker": dict.fromkeys(WorkerStats.FIELDS, 0.0),
            "worker_seconds": None,
            "handed_over": 0,
        }

    @property
    def role_info(self) -> Role:
        if self._role is None:
            self._role = role_from_env(self.cfg.launch.local_workers, self.cfg.ps.servers)
        return self._role

    @property
    def average_every(self) -> int:
        return self.cfg.ps.average_every or DEFAULT_AVERAGE_EVERY

    # ------------------------------------------------------------------------------ roles

    def role(self) -> str:
        """Server shards serve; a worker rank supervises a child process that trains (see supervisor.py),
        and that child, started with the explicit ``trainer`` role, trains."""
        return SERVER if self.role_info.kind == "server" else SUPERVISOR

    def serve(self) -> Result:
        return serve(self.cfg, self.role_info)

    def supervise(self, trainer: Callable[[], Result]) -> Result:
        return supervise(
            trainer, self.role_info.index, stopped_limit_s=self.cfg.ps.heartbeat_timeout + STOPPED_MARGIN_S
        )

    def worker_device(self, requested: torch.device) -> torch.device:
        """Workers as in sync mode (CUDA: ``cuda:LOCAL_RANK``); servers keep their shard in host memory."""
        return torch.device("cpu") if self.role_info.kind == "server" else worker_device(requested)

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """RPC for the worker, the workers' collectives through server 0, the main-worker election.

        No gloo group among the workers: it would fail for good with the first dead worker. On a clean
        exit every worker meets the others once more, then tells the servers it is leaving.
        """
        role = self.role_info
        torch.set_num_threads(threads_per_worker(self.cfg.run.threads, self.cfg.launch.local_workers))
        with rpc_session(role.name, role.rank, role.world, self.cfg.ps.rpc_timeout, threads=rpc_threads(role)):
            self.collectives = collectives = RpcCollectives(role.index, role.workers)
            with installed_collectives(collectives):
                main = tsdist.elect_main_rank(self.cfg.launch.node_rank == 0 and tsdist.local_rank() == 0)
                with tsdist.quiet_unless_main():
                    log.info(
                        "%s mode: worker %d of %d, %d server shard(s); worker %d writes the run folder",
                        self.name,
                        role.index,
                        role.workers,
                        role.servers,
                        main,
                    )
                    yield
                tsdist.barrier()
                assert self.client is not None  # wrap_optimizer ran inside the session
                self.client.leave()

    # ------------------------------------------------------------------------------ the trainer's hooks

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The PS optimizer over the local one's parameters and hyperparameters; seeds the servers."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        codec = self.push_codec(model, params)
        self.client = ShardClient(
            self.role_info.index, self.role_info.servers, sum(p.numel() for p in params), self.cfg.ps.rpc_timeout, codec
        )
        rule = self.async_remedies(
            dataclasses.replace(
                rule_from(optimizer, self.name, self.cfg.ps.staleness), codec=codec.spec if codec is not None else None
            )
        )
        rule = servers_momentum_for(rule, codec)
        self.optimizer = PSOptimizer(
            optimizer,
            self.client,
            rule,
            self.average_every,
            self.clock,
            injected_slowdown(self.role_info.index, self.job.ps_slow),
            self._fault(),
        )
        self.optimizer.start()
        return self.optimizer

    def push_codec(self, model: nn.Module, params: list[torch.Tensor]) -> PushCodec | None:
        """The worker's encoder of compressed pushes (``--compress``, error feedback here), or None: dense fp32."""
        spec = codec_from_config(self.cfg.compression, self.cfg.run.seed)
        return PushCodec(spec, units=unit_sizes(model, params)) if spec is not None else None

    def _fault(self) -> InjectedFault | None:
        """This worker's ``--inject-fault`` (the first one naming it; one worker dies once, and an attempt restarted
        after a server's death does not meet it again)."""
        return next(
            (
                f
                for f in not_yet_fired(injected_faults(self.cfg.faults))
                if not f.server and f.rank == self.role_info.index
            ),
            None,
        )

    def async_remedies(self, rule: Rule) -> Rule:
        """ASGD's server momentum (``--async-momentum``, resolved for the job's workers) and staleness-aware lr
        (``--staleness-lr``), logged once; other rules are returned unchanged."""
        if self.name != "async":
            return rule
        workers = self.role_info.workers
        momentum = resolve_async_momentum(self.cfg.ps.async_momentum, rule.momentum, workers)
        how = (
            f"--momentum {rule.momentum:g} less 1 - 1/{workers} for {workers} asynchronous worker(s)"
            if parse_async_momentum(self.cfg.ps.async_momentum) is None
            else "--async-momentum"
        )
        log.info(
            "async: server momentum %g (%s), staleness-aware lr %s",
            momentum,
            how,
            "on (each gradient x 1/(1 + staleness))" if self.cfg.ps.staleness_lr else "off",
        )
        # torch's SGD refuses Nesterov without momentum; with none left there is nothing to look ahead with
        return dataclasses.replace(
            rule, momentum=momentum, nesterov=rule.nesterov and momentum > 0, staleness_lr=self.cfg.ps.staleness_lr
        )

    def wrap_batches(self, train: Batches, test: Batches) -> tuple[Batches, Batches]:
        """Warm-start epochs and hand-overs for training; the whole test set on node 0's workers, evaluated by
        whichever is the main worker at the time (see batches.py)."""
        is_main = tsdist.is_main_process()
        assert self.client is not None and self.collectives is not None  # session, then wrap_optimizer, came first
        self.handover = HandOver(
            self.role_info.index, getattr(train, "inner", train), self.client, self.collectives.plan, self.optimizer
        )
        self.batches = TrainBatches(
            train,
            self.clock,
            self.cfg.ps.warm_start_epochs,
            is_main,
            tsdist.main_rank(),
            self.client.begin_epoch,
            self.client,
            self.handover,
        )
        return self.batches, MainOnly(unsharded(test)) if self.standby_writer else EmptyBatches()

    @property
    def standby_writer(self) -> bool:  # type: ignore[override]
        """Node 0's workers may take over the run folder (it is on node 0)."""
        return self.cfg.launch.node_rank == 0

    def writes_run_folder(self) -> Writes:
        """The main worker writes; rows so far may have been written by a main worker that died since."""
        return Writes.SHARED if tsdist.is_main_process() else Writes.NOT_NOW

    def after_train_epoch(self, model: nn.Module) -> None:
        """Epoch barrier, then every worker takes the servers' parameters and the mean BN statistics, and the
        main worker is elected again (it may have died)."""
        assert self.optimizer is not None
        self.optimizer.end_epoch()
        average_bn_over_live_workers(model)
        self.clock.next_epoch += 1
        self._elect_main()

    def _elect_main(self) -> None:
        """The lowest live worker of node 0 evaluates and writes the run folder: worker 0 until it dies."""
        role, before = self.role_info, tsdist.main_rank()
        me = torch.tensor([role.index if self.standby_writer else role.workers], dtype=torch.int64)
        chosen = int(tsdist.all_reduce_min(me).item())
        if chosen >= role.workers:
            raise PSError(
                "every worker of node 0 died, and the run folder is there: the job cannot go on (--resume "
                "continues it from the last epoch's checkpoint)"
            )
        if chosen != before:
            tsdist.set_main_rank(chosen)
            if chosen == role.index:
                logging.getLogger("trainscale").setLevel(logging.NOTSET)  # it was quiet (quiet_unless_main)
                log.warning(
                    "worker %d is gone: worker %d takes over evaluating and writing the run folder", before, chosen
                )
                log_event("takeover", worker=chosen, previous=before)

    def epoch_stats(self) -> dict[str, Any]:
        """Per-epoch figures: the workers' part summed by one collective (every worker keeps the run's totals,
        so any may take over), the servers' asked by the main worker."""
        role = self.role_info
        assert self.client is not None and self.batches is not None and self.handover is not None
        stats = self.client.stats
        samples, seconds = self.batches.finished
        mine = torch.zeros(2 * role.workers + len(WorkerStats.FIELDS) + 1, dtype=torch.float64)
        mine[: len(WorkerStats.FIELDS)] = torch.tensor(stats.as_list(), dtype=torch.float64)
        mine[len(WorkerStats.FIELDS) + role.index] = samples
        mine[len(WorkerStats.FIELDS) + role.workers + role.index] = seconds
        mine[-1] = self.handover.trained
        total = tsdist.all_reduce_sum(mine)
        stats.reset()
        self.handover.trained = 0
        part = self._accumulate(total)
        if not tsdist.is_main_process():
            return {}
        return self._row(part)

    def _accumulate(self, total: torch.Tensor) -> dict[str, Any]:
        """This epoch's workers' figures from the summed vector, added to the run's totals."""
        n, w = len(WorkerStats.FIELDS), self.role_info.workers
        part: dict[str, Any]
        part = {
            "workers": dict(zip(WorkerStats.FIELDS, total[:n].tolist())),
            "samples": total[n : n + w].tolist(),
            "seconds": total[n + w : -1].tolist(),
            "handed_over": int(total[-1]),
        }
        part["epoch_seconds"] = max(part["seconds"]) if part["seconds"] else 0.0
        t = self.totals
        t["worker"] = {k: t["worker"][k] + part["workers"][k] for k in part["workers"]}
        t["seconds"] += part["epoch_seconds"]
        t["handed_over"] += part["handed_over"]
        t["worker_samples"] = [a + b for a, b in zip(t["worker_samples"] or [0.0] * w, part["samples"])]
        t["worker_seconds"] = [a + b for a, b in zip(t["worker_seconds"] or [0.0] * w, part["seconds"])]
        return part

    def _row(self, part: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        server = merge_server_stats(self.client.take_stats())
        self.totals["server"] = merge_server_stats(self.client.run_totals())  # the run's, whoever asked before
        row = epoch_row(server, part["workers"], part["epoch_seconds"], self.role_info.servers)
        row[K.worker_samples_per_sec] = [s / t if t > 0 else 0.0 for s, t in zip(part["samples"], part["seconds"])]
        row[K.workers_finished] = sum(1 for n in part["samples"] if n > 0)  # finished this epoch's pass (warm: 1)
        row[K.handed_over_batches] = part["handed_over"]  # of dead workers' shards, trained by the live ones
        return row

    def run_stats(self) -> dict[str, Any]:
        """Whole-run figures from the per-epoch totals (no communication: every worker may call it)."""
        t = self.totals
        if t["worker_samples"] is None:
            return {}
        run = epoch_row(t["server"], t["worker"], t["seconds"], self.role_info.servers)
        run.pop(K.ps_pushes)
        run[K.handed_over_batches] = t["handed_over"]
        run[K.worker_samples_per_sec] = [
            s / x if x > 0 else 0.0 for s, x in zip(t["worker_samples"], t["worker_seconds"])
        ]
        return run

    def describe(self) -> dict[str, Any]:
        role = self.role_info
        return {
            "backend": "rpc",
            "transport": "torch.distributed.rpc (TensorPipe)",
            "workers": role.workers,
            "servers": role.servers,
            "ps_rule": self.name,
            "staleness_bound": self.cfg.ps.staleness,
            "async_momentum": self.optimizer.rule.momentum if self.name == "async" and self.optimizer else None,
            "staleness_lr": bool(self.cfg.ps.staleness_lr) if self.name == "async" else None,
            "average_every": self.average_every if self.name == "ma" else None,
            "warm_start_epochs": self.cfg.ps.warm_start_epochs,
            "batchnorm": BATCHNORM,
            "evaluation": EVALUATION,
            "push_compression": self.client.codec.compressor.describe() if self.client and self.client.codec else None,
            **self.compression_keys(),
            "bytes_scope": "payload per worker step: pushed = gradient (ma: parameter change at each average; "
            "compressed payload when pushes are compressed), pulled = fp32 parameters, summed "
            "over shards; RPC framing not included",
        }

    def compression_keys(self) -> dict[str, Any]:
        """The compression keys sync mode reports (``compress_method``, ...), for the pushes."""
        codec = self.client.codec if self.client is not None else None
        if codec is None:
            return {"compress_method": "none"}
        return {**codec.spec.describe(), "dense_below": None}  # pushes compress whole shard slices


def servers_momentum_for(rule: Rule, codec: PushCodec | None) -> Rule:
    """``rule`` with the servers' momentum off where the compressor applies momentum itself on the workers (DGC's
    momentum correction; sync mode switches the optimizer's off alike), else unchanged."""
    if codec is None or not codec.compressor.replaces_optimizer_momentum or not rule.momentum:
        return rule
    log.info("%s: the servers' momentum off (its momentum correction on the workers replaces it)", codec.spec.method)
    return dataclasses.replace(rule, momentum=0.0, nesterov=False)


def unit_sizes(model: nn.Module, params: list[torch.Tensor]) -> list[tuple[str, int]]:
    """(name, numel) of ``params`` in the flat vector's order: the units of layer-wise compressed pushes."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [(names.get(id(p), f"param{i}"), p.numel()) for i, p in enumerate(params)]


def rpc_threads(role: Role) -> int:
    """RPC threads per process: waits are Futures, so a few per peer suffice."""
    return max(16, 2 * (role.workers + role.servers))


@torch.no_grad()
def average_bn_over_live_workers(model: nn.Module) -> None:
    """Replace BN running statistics by their mean over the workers still alive (one collective)."""
    buffers = [
        b
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        for b in (m.running_mean, m.running_var)
        if b is not None
    ]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in buffers] + [torch.ones(1, dtype=torch.float64)])
    flat = tsdist.all_reduce_sum(flat)
    flat = flat[:-1] / flat[-1]
    offset = 0
    for b in buffers:
        b.copy_(flat[offset : offset + b.numel()].view_as(b))
        offset += b.numel()


def serve(cfg: TrainConfig, role: Role) -> Result:
    """A server shard's whole life: answer RPCs until every worker has left or died."""
    torch.set_num_threads(cfg.run.threads or 1)
    # a ping at least 4 times per timeout, so a hang is seen within 1.25 timeouts
    membership = Membership(
        role.workers, heartbeat_s=min(1.0, cfg.ps.heartbeat_timeout / 4), timeout_s=cfg.ps.heartbeat_timeout
    )
    shard = ShardServer(role.index, membership)
    fault = next((f for f in not_yet_fired(injected_faults(cfg.faults)) if f.server and f.rank == role.index), None)
    handlers.install(shard, membership, Coordinator(membership) if role.index == 0 else None, fault)
    try:
        with rpc_session(role.name, role.rank, role.world, cfg.ps.rpc_timeout, threads=rpc_threads(role)):
            if restart_count() > 0:  # the job restarted (a server died): back, the checkpoint's state to come
                log_event("restarted", shard=role.index)
            membership.start()
            try:
                membership.wait_all_gone()
            finally:
                membership.stop()
    finally:
        handlers.uninstall()
    if membership.dead:
        log.warning(
            "server %d: finished; dead worker(s): %s",
            role.index,
            ", ".join(f"{w} ({why})" for w, why in sorted(membership.dead.items())),
        )
    else:
        log.info("server %d: every worker finished; %d update(s) applied", role.index, shard.version)
    return {}, []
