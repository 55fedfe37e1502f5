"""One replica's torchft session: the Manager, the job's data position, each step's quorum and commit, healing
from a peer, and leaving a job the others finished."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainscale.compression.ddp_hook import CompressionHookState
from trainscale.log import relabel
from trainscale.runtime import ft
from trainscale.runtime.faults import InjectedFault, injected_faults, not_yet_fired
from trainscale.runtime.job import Job

log = logging.getLogger("trainscale.ft")

BUCKET_BYTES = 25 * 1024 * 1024  # gradients are averaged in buckets of this size, as DDP's default


class JobFinished(Exception):
    """A restarted replica found the job finished by the others: it leaves without training."""


@dataclass
class Position:
    """Where the job is in its data: the epoch and the per-worker batches its committed steps took."""

    epoch: int = 0
    batches: int = 0


class ReplicaSession:
    """This replica's part of a fault-tolerant sync job: the Manager, the data position, the step's commit."""

    def __init__(self, cfg: Any, job: Job) -> None:
        self.job = job
        self.timeout_s = cfg.replication.ft_timeout
        self.quorum_timeout_s = max(cfg.launch.dist_timeout, 60.0)
        self.faults = unfired(injected_faults(cfg.faults), job.replica)
        self.link_down_s = cfg.faults.link_down
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
        relabel(f"replica {self.job.replica}")
        assert self.job.master is not None, "a replica runs under its own elastic agent (MASTER_ADDR, MASTER_PORT)"
        with ft.manager(
            self._state,
            self._load,
            self.timeout_s,
            self.quorum_timeout_s,
            device,
            self.job.replica or 0,
            self.job.master,
        ) as manager:
            self.manager = manager
            yield
            self._finished()

    def attach(self, snapshot: Callable[[], dict[str, Any]], restore: Callable[[dict[str, Any]], None]) -> None:
        """Take the trainer's whole-state functions, wait for every first-attempt replica, and join the first
        quorum: a restarted replica heals here, before its first epoch, so it starts where the live ones are."""
        self.snapshot, self.restore = snapshot, restore
        restarted = self.job.restarts > 0
        ft.start_barrier(None if restarted else self.job.barrier, self.job.replicas, self.quorum_timeout_s)
        self.quorum()
        if restarted and self.manager.current_step() == 0 and ft.job_finished():
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
        return {
            "trainer": self.snapshot(),
            "position": dict(self.position.__dict__),
            "compression": shared_compression_state(self.compression),
        }

    def _load(self, state: dict[str, Any]) -> None:
        assert self.restore is not None
        self.restore(state["trainer"])
        self.position = Position(**state["position"])
        if self.compression is not None and state.get("compression"):
            self.compression.load_state_dict(state["compression"])
        if (self.position.epoch, self.position.batches) == (0, 0):  # every replica starts from one model: no fault
            log.info("took the starting model from a peer")
        else:
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
            fault.fire(self.link_down_s, self.job)
        exchange()
        committed = bool(self.manager.should_commit())
        if not committed:
            ft.log_event("aborted", step=self.manager.current_step() + 1)
            log.warning(
                "step %d not committed (a replica failed during it); it is taken again", self.manager.current_step() + 1
            )
        return committed

    def exchange_committed(
        self, owner: Any, also: list[torch.Tensor], exchange: Callable[[], list[torch.Tensor]]
    ) -> list[torch.Tensor] | None:
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
