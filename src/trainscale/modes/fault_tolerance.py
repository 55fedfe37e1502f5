"""Sync mode's per-step fault tolerance (``--fault-tolerance``): a dead worker costs at most one step.

Each worker is a torchft replica with a world of its own. Every step it joins the quorum (the
lighthouse's list of live replicas), trains on its slice of the step's global batch, averages gradients
and BatchNorm running statistics with the other members through the Manager (a fault-tolerant gloo
all-reduce), and applies them only if the Manager commits the step. A member that dies or hangs makes the
step's all-reduce fail: the step is not applied anywhere (one step lost), the next quorum goes on without
it, and when its agent has restarted it, it heals by copying a live member's whole state (model,
optimizer, run state, data position) before its first step.

The run folder: every replica holds a writer, and at each epoch's end the quorum's first member writes
(re-reading the rows written so far), so the record goes on when the replica that was writing dies.

Samples (what the README promises): every replica walks the same per-epoch permutation; the job's data
position counts the per-worker batches of committed steps, and a step with n members trains on the next
n of them, member r on the r-th. So within an epoch no sample is trained on twice by committed steps and
none is skipped while the members stay the same; a step that is not committed leaves the position where
it was, and the next step (with whoever is left) takes those batches again. An epoch ends when fewer
batches are left than members: at most members-1 batches of it go unused, like a partial last batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trainscale.compression.ddp_hook import CompressionHookState
from trainscale.compression.setup import CompressionPlan
from trainscale.errors import ConfigError
from trainscale.runtime import ft
from trainscale.runtime.dist import restart_count
from trainscale.log import relabel
from trainscale.runtime.faults import (InjectedFault, check_link_down, injected_faults, job_processes,
                                      not_yet_fired, on_cluster)

log = logging.getLogger("trainscale.ft")

BUCKET_BYTES = 25 * 1024 * 1024  # gradients are averaged in buckets of this size, as DDP's default


FT_MODES = ("sync", "localsgd", "diloco")


def validate_fault_tolerance(cfg: Any) -> None:
    """--fault-tolerance and --inject-fault against the rest of the config (one ConfigError line). Under
    ``--cluster`` the parent knows the hosts only once it has read the cluster: it checks again with ``nnodes``
    set to them (``app.preflight``), so replica numbers are bounded there."""
    if cfg.inject_fault and not cfg.fault_tolerance:
        raise ConfigError("--inject-fault needs --fault-tolerance (a plain sync job stops at the first dead worker)")
    if cfg.mode not in FT_MODES:
        raise ConfigError(f"--fault-tolerance works with --mode {', '.join(FT_MODES)}, not {cfg.mode}")
    ft.require_torchft()
    if cfg.precision == "fp16":
        raise ConfigError("--fault-tolerance needs --precision bf16 or fp32 (fp16's grad scaler may skip a step on "
                          "one replica only)")
    if cfg.ft_timeout <= 0:
        raise ConfigError(f"--ft-timeout must be a positive number of seconds, got {cfg.ft_timeout}")
    if cfg.nnodes > 1 and not cfg.out:
        raise ConfigError("--fault-tolerance on several machines needs --out, the same folder on a file system "
                          "every machine shares (any replica may take over writing the run)")
    for fault in injected_faults(cfg):
        validate_injected(fault, cfg)


def validate_injected(fault: InjectedFault, cfg: Any) -> None:
    """One --inject-fault against the job's replicas (``workers`` per node) and, for a link cut, its cluster."""
    workers, replicas = cfg.workers or 1, job_processes(cfg)
    what = f"--inject-fault {fault.text}"
    if fault.server:
        raise ConfigError(f"{what}: s{fault.rank} names a parameter-server shard; a fault-tolerant job has replicas "
                          "only (give a replica's number)")
    if replicas is not None and fault.rank >= replicas:
        raise ConfigError(f"{what}: there are only {replicas} replicas (0..{replicas - 1})")
    if fault.kind != "link":
        return
    if not (getattr(cfg, "cluster", None) or on_cluster()):
        raise ConfigError(f"{what} cuts a host's link on an emulated cluster: run with --cluster NAME "
                          "(trainscale cluster up), or use kill or hang")
    if fault.rank < workers:
        raise ConfigError(f"{what}: replica {fault.rank} is on host 0, whose link carries the lighthouse every "
                          f"replica needs; cut another host's (replicas {workers}..)")


class JobFinished(Exception):
    """A restarted replica found the job finished by the others: it leaves without training."""


@dataclass
class Position:
    """Where the job is in its data: the epoch and the per-worker batches its committed steps took."""

    epoch: int = 0
    batches: int = 0


class ReplicaSession:
    """This replica's part of a fault-tolerant sync job: the Manager, the data position, the step's commit."""

    def __init__(self, cfg: Any) -> None:
        self.timeout_s = cfg.ft_timeout
        self.quorum_timeout_s = max(cfg.dist_timeout, 60.0)
        self.faults = unfired(injected_faults(cfg), ft.replica())
        self.link_down_s = cfg.link_down
        self.position = Position()
        self.manager: Any = None
        self.members = 0
        self.member_rank = 0
        self.epoch_batches = 0  # per-worker batches the job's committed steps took in the last epoch
        self.batch_size = 0
        self.fresh = False  # a quorum was joined that no step has used yet
        self.left = False  # the job was over when this replica came to it
        self.snapshot: Callable[[], dict[str, Any]] | None = None
        self.restore: Callable[[dict[str, Any]], None] | None = None
        self.model: nn.Module | None = None
        self.stats: list[torch.Tensor] = []  # BatchNorm running statistics, and their copy before the step
        self.saved: list[torch.Tensor] = []
        self.compression: CompressionHookState | None = None  # the compressed exchange's, when --compress

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Build this replica's Manager for the run; always shut it down."""
        relabel(f"replica {ft.replica()}")
        with ft.manager(self._state, self._load, self.timeout_s, self.quorum_timeout_s, device) as manager:
            self.manager = manager
            yield
            self._finished()

    def attach(self, snapshot: Callable[[], dict[str, Any]], restore: Callable[[dict[str, Any]], None]) -> None:
        """Take the trainer's whole-state functions, wait for every first-attempt replica, and join the first
        quorum: a restarted replica heals here, before its first epoch, so it starts where the live ones are."""
        self.snapshot, self.restore = snapshot, restore
        ft.start_barrier(self.quorum_timeout_s)
        self.quorum()
        if restart_count() > 0 and self.manager.current_step() == 0 and ft.job_finished():
            self._leave("the other replicas have finished the job")

    def _leave(self, why: str) -> None:
        """Leave a job that is over without training: its record is the others' (no ``final`` digest of a stale
        model), the launcher learns this replica is done from the ``left`` event."""
        log.warning("%s: nothing left to do", why)
        ft.log_event("left", step=self.manager.current_step())
        self.left = True
        raise JobFinished

    def _state(self) -> dict[str, Any]:
        assert self.snapshot is not None
        return {"trainer": self.snapshot(), "position": dict(self.position.__dict__),
                "compression": shared_compression_state(self.compression)}

    def _load(self, state: dict[str, Any]) -> None:
        assert self.restore is not None
        self.restore(state["trainer"])
        self.position = Position(**state["position"])
        if self.compression is not None and state.get("compression"):
            self.compression.load_state_dict(state["compression"])
        log.warning("healed from a peer: epoch %d, batch %d", self.position.epoch + 1, self.position.batches)
        ft.log_event("healed", step=self.manager.current_step() if self.manager else None)

    def quorum(self) -> None:
        """Join this step's quorum (healing if behind)."""
        self.manager.start_quorum()
        step = self.manager.current_step() + 1
        members = self.manager.num_participants()
        if members != self.members:
            if self.members and ft.job_finished():  # cut off (a link) or stopped until the others were done
                self._leave("the other replicas finished the job while this one was away")
            ft.log_event("members", step=step, members=members)
            if self.members:
                log.warning("step %d: %d replica(s) in the quorum (were %d)", step, members, self.members)
        self.members = members
        self.member_rank = self.manager.participating_rank() or 0
        self.fresh = True
        quiet(self.member_rank != 0)

    def commit(self, exchange: Callable[[], None]) -> bool:
        """Run the step's ``exchange`` over the quorum; True if the step is committed everywhere (apply it).
        An injected fault due at this step fires first: after the backward, as the exchange starts."""
        due = self.manager.current_step() + 1
        for fault in [f for f in self.faults if f.step == due]:
            self.faults.remove(fault)
            fault.fire(self.link_down_s)
        exchange()
        committed = bool(self.manager.should_commit())
        if not committed:
            ft.log_event("aborted", step=self.manager.current_step() + 1)
            log.warning("step %d not committed (a replica failed during it); it is taken again",
                        self.manager.current_step() + 1)
        return committed

    def exchange_committed(self, owner: Any, also: list[torch.Tensor],
                           exchange: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor] | None:
        """A committed compressed exchange: ``exchange()``'s results, with ``also`` averaged in place beside them;
        or None when the step is not committed, with ``owner``'s state (a compressor's: residuals, Q, the step
        clock) put back as it was before and ``also`` untouched (it travels as a copy)."""
        saved, flat, out = owner.state_dict(), buckets(also), []

        def run() -> None:
            out.extend(exchange())
            self.average([f for f, _ in flat])

        if not self.commit(run):
            owner.load_state_dict(saved)
            return None
        unflatten_into(flat)
        return out

    def advance(self) -> None:
        """The step's batches are trained on: the job's data position moves past them (one per member)."""
        self.position.batches += self.members

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average float ``tensors`` in place over the quorum (garbage if the step fails: it is not committed)."""
        works = [self.manager.allreduce(t) for t in tensors]
        for work in works:
            work.wait()

    def transport(self) -> ft.QuorumTransport:
        """The quorum as the compression layer's transport."""
        return ft.QuorumTransport(self.manager)

    def _finished(self) -> None:
        """The end of training: record this replica's final step and the digest of its parameters and buffers."""
        if self.model is not None and not self.left:
            ft.log_event("final", step=self.manager.current_step(), digest=state_digest(self.model))


def unfired(faults: list[InjectedFault], replica: int | None) -> list[InjectedFault]:
    """This replica's faults that no earlier attempt of it has fired (a chaos run faults each many times)."""
    return [f for f in not_yet_fired(faults) if f.rank == replica and not f.server]


def quiet(value: bool) -> None:
    """Only the quorum's first member logs progress (every member computes the same epoch line)."""
    logging.getLogger("trainscale").setLevel(logging.WARNING if value else logging.NOTSET)


def state_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer, in state-dict order: equal digests, bitwise-equal replicas."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReplicaBatches:
    """The training batches of a replica: the whole epoch's permutation (the same on every replica),
    walked by the job's data position, this replica taking its member rank's batch of each step."""

    def __init__(self, full: Any, session: ReplicaSession) -> None:
        self.full = full
        self.session = session
        session.batch_size = full.batch_size
        self.progress = 0.0

    def __len__(self) -> int:
        return len(self.full) // max(1, ft.replicas())

    @property
    def num_samples(self) -> int:
        return self.full.num_samples

    def __getattr__(self, name: str) -> Any:
        return getattr(self.full, name)

    def epoch(self, epoch: int) -> Iterator[Any]:
        s = self.session
        total = len(self.full)
        source, taken = iter(self.full.lazy_epoch(epoch)), 0
        if s.position.epoch < epoch:  # resumed from a checkpoint: the epoch's start
            s.position = Position(epoch, 0)
        first: int | None = None  # where this replica's pass began (later than 0 after healing mid-epoch)
        while True:
            if not s.fresh:
                s.quorum()
            if s.position.epoch != epoch:  # healed into another epoch
                return
            if s.position.batches + s.members > total:
                s.epoch_batches = s.position.batches - (first or 0)  # the job's, over this replica's pass
                s.position = Position(epoch + 1, 0)
                return
            s.fresh = False
            first = s.position.batches if first is None else first
            want = s.position.batches + s.member_rank
            if want < taken:
                source, taken = iter(self.full.lazy_epoch(epoch)), 0
            for _ in range(want - taken):
                next(source)
            taken = want + 1
            self.progress = s.position.batches / total
            s.saved = [b.clone() for b in s.stats]  # the step's forward updates them
            yield next(source)()


class CommittingOptimizer:
    """The optimizer the training loop steps under fault tolerance: ``step`` averages the gradients and
    the BatchNorm running statistics over the quorum, and applies them only if the step is committed
    (otherwise the statistics are put back as they were before the step's forward).

    With ``compression`` the gradients go through trainscale's compressed exchange over the quorum (the same
    ``CompressionHookState`` that DDP's hook and DiLoCo's outer step use), layer by layer or as one vector.
    Its state (error-feedback residuals, PowerSGD's Q, the step clock) is saved before the step and put
    back when the step is not committed, so an aborted step leaves no trace on any replica."""

    def __init__(self, inner: torch.optim.Optimizer, model: nn.Module, session: ReplicaSession,
                 compression: CompressionPlan | None = None) -> None:
        self.inner, self.session = inner, session
        self.stats = session.stats = bn_buffers(model)
        self.averaged = [b for b in self.stats if b.is_floating_point()]  # the step counters are equal anyway
        self.hook: CompressionHookState | None = None
        if compression is not None and compression.enabled:
            self.hook = session.compression = CompressionHookState(
                compression.compressor(), compression.granularity, model=model,
                error_feedback=compression.error_feedback, warmup_epochs=compression.warmup_epochs,
                group=session.transport())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        params = [p for group in self.inner.param_groups for p in group["params"] if p.grad is not None]
        committed = self._dense_step(params) if self.hook is None else self._compressed_step(params)
        if committed:
            self.session.advance()
            self.inner.step()
        else:
            for b, saved in zip(self.stats, self.session.saved):
                b.copy_(saved)

    def _dense_step(self, params: list[nn.Parameter]) -> bool:
        flat = buckets([p.grad for p in params] + self.averaged)
        if not self.session.commit(lambda: self.session.average([f for f, _ in flat])):
            return False
        unflatten_into(flat)
        return True

    def _compressed_step(self, params: list[nn.Parameter]) -> bool:
        hook = self.hook
        assert hook is not None
        averaged = self.session.exchange_committed(hook, self.averaged,
                                                   lambda: hook.reduce_params([(p, p.grad) for p in params]))
        if averaged is None:
            return False
        hook.end_step()
        for p, g in zip(params, averaged):
            p.grad.copy_(g)
        return True

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def unflatten_into(flat: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
    """Copy each averaged bucket back into the tensors it was made of."""
    for f, tensors in flat:
        for t, v in zip(tensors, torch._utils._unflatten_dense_tensors(f, tensors)):
            t.copy_(v)


def shared_compression_state(hook: CompressionHookState | None) -> dict[str, Any] | None:
    """What a healing replica takes of a peer's compressed exchange: the step clock, and the compressor's state
    where it is the same on every replica (``shared_state``: PowerSGD's Q); not what is the peer's own (its
    error-feedback residuals, DGC's momenta): a restarted replica starts without, like a new worker."""
    if hook is None:
        return None
    state = hook.state_dict()
    compressor = state["exchange"]["compressor"] if hook.compressor.shared_state else {}
    return {**state, "exchange": {"feedback": {"residuals": {}}, "compressor": compressor}}


def bn_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every BatchNorm layer's running mean and variance (where it tracks them) and its step counter."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            out += [b for b in (module.running_mean, module.running_var, module.num_batches_tracked) if b is not None]
    return out


def buckets(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """``tensors`` flattened into fp32 buckets of about BUCKET_BYTES, each with the tensors it holds."""
    out: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    group: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        group.append(t)
        size += t.numel() * 4
        if size >= BUCKET_BYTES:
            out.append((torch._utils._flatten_dense_tensors([g.float() for g in group]), group))
            group, size = [], 0
    if group:
        out.append((torch._utils._flatten_dense_tensors([g.float() for g in group]), group))
    return out


