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
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trainscale.errors import ConfigError
from trainscale.runtime import ft
from trainscale.log import relabel
from trainscale.runtime.faults import InjectedFault, parse_injected_fault

log = logging.getLogger("trainscale.ft")

BUCKET_BYTES = 25 * 1024 * 1024  # gradients are averaged in buckets of this size, as DDP's default


def validate_fault_tolerance(cfg: Any) -> None:
    """--fault-tolerance and --inject-fault against the rest of the config (one ConfigError line)."""
    if cfg.inject_fault and not cfg.fault_tolerance:
        raise ConfigError("--inject-fault needs --fault-tolerance (a plain sync job stops at the first dead worker)")
    if cfg.mode != "sync":
        raise ConfigError(f"--fault-tolerance works with --mode sync so far, not {cfg.mode}")
    if cfg.nnodes > 1 or getattr(cfg, "cluster", None):
        raise ConfigError("--fault-tolerance runs on one machine so far (--workers N replicas); drop --nnodes/--cluster")
    ft.require_torchft()
    if getattr(cfg, "compress", "none") not in (None, "none"):
        raise ConfigError("--fault-tolerance averages dense gradients so far; drop --compress")
    if cfg.precision == "fp16":
        raise ConfigError("--fault-tolerance needs --precision bf16 or fp32 (fp16's grad scaler may skip a step on "
                          "one replica only)")
    if cfg.ft_timeout <= 0:
        raise ConfigError(f"--ft-timeout must be a positive number of seconds, got {cfg.ft_timeout}")
    workers = cfg.workers or 1
    for fault in injected_faults(cfg):
        if fault.rank >= workers:
            raise ConfigError(f"--inject-fault {fault.kind}:{fault.rank}@{fault.step}: there are only {workers} "
                              f"replicas (0..{workers - 1})")
        if fault.kind == "link":
            raise ConfigError("--inject-fault link:... cuts a host's link on an emulated cluster; fault-tolerant jobs "
                              "run on one machine so far: use kill or hang")


def injected_faults(cfg: Any) -> list[InjectedFault]:
    """``--inject-fault``'s faults (the flag's list items may hold several, comma-separated)."""
    return [parse_injected_fault(text.strip()) for item in cfg.inject_fault or [] for text in item.split(",")]


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
        self.position = Position()
        self.manager: Any = None
        self.members = 0
        self.member_rank = 0
        self.fresh = False  # a quorum was joined that no step has used yet
        self.snapshot: Callable[[], dict[str, Any]] | None = None
        self.restore: Callable[[dict[str, Any]], None] | None = None
        self.model: nn.Module | None = None
        self.stats: list[torch.Tensor] = []  # BatchNorm running statistics, and their copy before the step
        self.saved: list[torch.Tensor] = []

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
        if restarted() and self.manager.current_step() == 0 and ft.job_finished():
            log.warning("the other replicas have finished the job: nothing left to do")
            raise JobFinished

    def _state(self) -> dict[str, Any]:
        assert self.snapshot is not None
        return {"trainer": self.snapshot(), "position": dict(self.position.__dict__)}

    def _load(self, state: dict[str, Any]) -> None:
        assert self.restore is not None
        self.restore(state["trainer"])
        self.position = Position(**state["position"])
        log.warning("healed from a peer: epoch %d, batch %d", self.position.epoch + 1, self.position.batches)
        ft.log_event("healed", step=self.manager.current_step() if self.manager else None)

    def quorum(self) -> None:
        """Join this step's quorum (healing if behind)."""
        self.manager.start_quorum()
        step = self.manager.current_step() + 1
        members = self.manager.num_participants()
        if members != self.members:
            ft.log_event("members", step=step, members=members)
            if self.members:
                log.warning("step %d: %d replica(s) in the quorum (were %d)", step, members, self.members)
        self.members = members
        self.member_rank = self.manager.participating_rank() or 0
        self.fresh = True
        quiet(self.member_rank != 0)

    def commit(self, tensors: list[torch.Tensor]) -> bool:
        """Average ``tensors`` in place over the quorum; True if the step is committed everywhere (apply it).
        An injected fault due at this step fires first: after the backward, as the exchange starts."""
        due = self.manager.current_step() + 1
        for fault in [f for f in self.faults if f.step == due]:
            self.faults.remove(fault)
            fault.fire()
        works = [self.manager.allreduce(bucket) for bucket in tensors]
        for work in works:
            work.wait()
        committed = bool(self.manager.should_commit())
        if committed:
            self.position.batches += self.members
        else:
            ft.log_event("aborted", step=self.manager.current_step() + 1)
            log.warning("step %d not committed (a replica failed during it); it is taken again",
                        self.manager.current_step() + 1)
        return committed

    def _finished(self) -> None:
        """The end of training: record this replica's final step and the digest of its parameters and buffers."""
        if self.model is not None:
            ft.log_event("final", step=self.manager.current_step(), digest=state_digest(self.model))


def unfired(faults: list[InjectedFault], replica: int | None) -> list[InjectedFault]:
    """This replica's faults that no earlier attempt of it has fired (the job's fault log says which did), so a
    restarted replica goes on meeting its later faults and never repeats one (a chaos run faults each many times)."""
    done = {(e["kind"], e["rank"], e["step"]) for e in ft.job_events() if e["event"] == "fault"}
    return [f for f in faults if f.rank == replica and (f.kind, f.rank, f.step) not in done]


def quiet(value: bool) -> None:
    """Only the quorum's first member logs progress (every member computes the same epoch line)."""
    logging.getLogger("trainscale").setLevel(logging.WARNING if value else logging.NOTSET)


def restarted() -> bool:
    """Whether this replica's agent has restarted it (its first attempt fires the injected faults)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


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
        while True:
            if not s.fresh:
                s.quorum()
            if s.position.epoch != epoch:  # healed into another epoch
                return
            if s.position.batches + s.members > total:
                s.position = Position(epoch + 1, 0)
                return
            s.fresh = False
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
    (otherwise the statistics are put back as they were before the step's forward)."""

    def __init__(self, inner: torch.optim.Optimizer, model: nn.Module, session: ReplicaSession) -> None:
        self.inner, self.session = inner, session
        self.stats = session.stats = bn_buffers(model)
        self.averaged = [b for b in self.stats if b.is_floating_point()]  # the step counters are equal anyway

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        params = [p for group in self.inner.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        flat = buckets(grads + self.averaged)
        if self.session.commit([f for f, _ in flat]):
            for f, tensors in flat:
                for t, v in zip(tensors, torch._utils._unflatten_dense_tensors(f, tensors)):
                    t.copy_(v)
            self.inner.step()
        else:
            for b, saved in zip(self.stats, self.session.saved):
                b.copy_(saved)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


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


