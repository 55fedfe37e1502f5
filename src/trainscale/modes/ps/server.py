"""One parameter-server shard: a slice of the flat parameter vector and the rule that updates it.

Rules (``Rule.name``):

* ``async`` (ASGD): every push is applied at once by the shard's own SGD (momentum lives here, on
  the server; by default reduced for the workers' implicit momentum, see
  ``config.resolve_async_momentum``). With ``staleness_lr`` the gradient is first scaled by
  ``staleness_scale`` of the staleness this shard measured for it (staleness-aware ASGD; shards count
  their own versions, so the shards of one push may scale it differently). With ``staleness`` K, a
  pull is answered only when the pulling worker is at most K steps ahead of the slowest active worker
  in this epoch (stale synchronous parallel); otherwise it waits, without holding an RPC thread (the
  answer is a Future completed by a later push).
* ``ps-sync`` (BSP, like ps-lite's dist_sync): pushes of a step are summed until every active live
  worker has pushed; then the mean is applied once, and the pulls of that step are answered.
* ``ma`` (model averaging): workers push the change of their parameters since their last pull; when
  every active live worker has pushed, the mean change is added, and the pulls are answered.

Atomicity: one lock per shard is held over each whole read-modify-write (staleness bookkeeping, the
optimizer step, the version bump) and over every snapshot a pull returns, so a pull never sees half
an update and two pushes never interleave. Futures are completed outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from trainscale.compression.spec import CompressionSpec
from trainscale.modes.ps.codec import decode_push, payload_nbytes, push_compressor
from trainscale.modes.ps.membership import Membership
from trainscale.modes.ps.stats import ServerStats
from trainscale.runtime.ft import log_event

log = logging.getLogger("trainscale.ps")

# Per rule: does a step wait for every live worker's push (a round), and are pushes parameter changes that
# are averaged in (model averaging) rather than gradients for the server's optimizer?
ROUNDS = {"async": False, "ps-sync": True, "ma": True}
AVERAGES = {"async": False, "ps-sync": False, "ma": True}


@dataclass(frozen=True)
class Rule:
    """How a shard applies pushes; sent by the main worker with the initial parameters."""

    name: str
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0
    staleness: int | None = None
    codec: CompressionSpec | None = None  # compressed pushes (see codec.py); None: dense fp32
    staleness_lr: bool = False  # async: each gradient x staleness_scale(its staleness)

    @property
    def rounds(self) -> bool:
        """Pushes of one step are summed until every live worker has pushed (ps-sync, ma); else each push is
        applied at once (async, where the staleness bound applies instead)."""
        return ROUNDS[self.name]

    @property
    def averages(self) -> bool:
        """Pushes are parameter changes averaged straight in (ma), not gradients for an SGD step."""
        return AVERAGES[self.name]

    def describe(self) -> str:
        """One line for the server's log: the update rule as a user would state it."""
        nesterov = " (Nesterov)" if self.nesterov else ""
        sgd = f"SGD momentum {self.momentum:g}{nesterov}, weight decay {self.weight_decay:g}"
        bound = f", staleness bound {self.staleness}" if self.staleness is not None else ""
        if self.staleness_lr:
            bound += ", staleness-aware lr (gradient x 1/(1 + staleness))"
        pushes = f", {self.codec.text} pushes" if self.codec is not None else ", dense fp32 pushes"
        return f"{self.name} ({sgd}{bound}{pushes})"


def staleness_scale(staleness: int) -> float:
    """The factor on a gradient that arrives ``staleness`` updates after its worker's pull.

    Staleness-aware ASGD (Zhang et al. 2016) divides the learning rate by the gradient's staleness
    counted as they do, from 1 for a gradient computed on the current parameters; here staleness
    counts the updates in between (0 for a fresh gradient), hence ``1 / (1 + staleness)``. With W
    workers of equal speed staleness is about W - 1, so the mean factor is about 1/W and each worker's
    gradient moves the parameters about as much per sample as in synchronous SGD at the same lr.
    """
    return 1.0 / (1 + max(0, staleness))


@dataclass
class Round:
    """Pushes of one (epoch, step) being summed (ps-sync, ma)."""

    total: Tensor
    active: tuple[int, ...] | None
    contributors: set[int] = field(default_factory=set)
    lr: float = 0.0


@dataclass
class Waiter:
    worker: int
    epoch: int
    step: int | None
    active: tuple[int, ...] | None
    future: Future
    since: float


class ShardServer:
    """State and rules of one shard; the RPC handlers in ``handlers.py`` call these methods."""

    def __init__(self, index: int, membership: Membership) -> None:
        self.index = index
        self.membership = membership
        self.lock = threading.Lock()
        self.rule: Rule | None = None
        self.params: Tensor | None = None
        self.optimizer: torch.optim.SGD | None = None
        self.decoder: Any = None
        self.version = 0
        self.progress: dict[int, tuple[int, int]] = {}  # worker -> (epoch, pushes in that epoch)
        self.rounds: dict[tuple[int, int], Round] = {}
        self.last_round: tuple[int, int] = (-1, -1)
        self.waiting: list[Waiter] = []
        self.stats = ServerStats()
        self.deaths_seen = 0  # shard 0 logs the first update after each death (the job going on without it)
        self.note_next_update = False
        membership.subscribe(self.on_membership_change)

    # ------------------------------------------------------------------------------- set-up, state

    def initialize(self, params: Tensor, rule: Rule) -> int:
        """Take the initial slice and the rule (the main worker calls this once per run)."""
        if rule.name not in ROUNDS:
            raise ValueError(f"unknown rule {rule.name!r}")
        with self.lock:
            self.rule = rule
            self.decoder = push_compressor(rule.codec) if rule.codec is not None else None
            self.params = params.detach().clone().float()
            self.optimizer = None
            if not rule.averages:
                self.optimizer = torch.optim.SGD(
                    [self.params],
                    lr=0.0,
                    momentum=rule.momentum,
                    dampening=rule.dampening,
                    nesterov=rule.nesterov,
                    weight_decay=rule.weight_decay,
                )
            self.version = 0
        log.info("shard %d: %s parameters, %s", self.index, f"{self.params.numel():,}", rule.describe())
        return self.params.numel()

    def state(self) -> dict[str, Any]:
        """Parameters, momentum and version clock, copied under the lock (for the checkpoint)."""
        with self.lock:
            assert self.params is not None, "state() before initialize()"
            momentum = None
            if self.optimizer is not None:
                momentum = self.optimizer.state.get(self.params, {}).get("momentum_buffer")
            return {
                "params": self.params.clone(),
                "version": self.version,
                "momentum": None if momentum is None else momentum.clone(),
            }

    def load_state(self, state: dict[str, Any]) -> None:
        with self.lock:
            assert self.params is not None, "load_state() before initialize()"
            if state["params"].shape != self.params.shape:
                raise ValueError(
                    f"shard {self.index}: checkpoint slice has {state['params'].numel()} elements, "
                    f"this shard {self.params.numel()}; resume with the same --servers and model"
                )
            self.params.copy_(state["params"])
            self.version = int(state["version"])
            if self.optimizer is not None and state.get("momentum") is not None:
                self.optimizer.state[self.params]["momentum_buffer"] = state["momentum"].clone()

    def take_stats(self) -> dict[str, Any]:
        """Counters since the last call (then reset), with the workers this shard saw die so far."""
        with self.lock:
            out, self.stats = self.stats.to_dict(), ServerStats()
        out["dead_workers"] = sorted(self.membership.dead)
        return out

    # ------------------------------------------------------------------------------- push and pull

    def push(
        self,
        worker: int,
        epoch: int,
        step: int,
        payload: Any,
        lr: float,
        read_version: int,
        active: tuple[int, ...] | None,
    ) -> int:
        """Apply (async) or add to the step's round (ps-sync, ma); returns the staleness it saw.
        ``payload``: the dense slice, or a compressed one (decoded here, outside the lock; see codec.py)."""
        nbytes = payload_nbytes(payload)
        payload = decode_push(self.decoder, payload)
        with self.lock:
            assert self.rule is not None and self.params is not None, "push() before initialize()"
            staleness = self.version - read_version
            self.stats.record_push(staleness, nbytes)
            self.progress[worker] = (epoch, step + 1)
            if not self.rule.rounds:
                if self.rule.staleness_lr and staleness > 0:
                    payload = payload * staleness_scale(staleness)
                self._apply_update(payload, lr)
            else:
                rnd = self.rounds.get((epoch, step))
                if rnd is None:
                    rnd = self.rounds[(epoch, step)] = Round(torch.zeros_like(self.params), active)
                rnd.total.add_(payload)
                rnd.contributors.add(worker)
                rnd.lr = lr
                self._close_rounds()
            ready = self._ready_waiters()
        _complete(ready)
        return staleness

    def pull(self, worker: int, epoch: int, step: int | None, active: tuple[int, ...] | None) -> Future:
        """A Future of (params, version, seconds waited); ``step`` None answers at once."""
        fut: Future = Future()
        waiter = Waiter(worker, epoch, step, active, fut, time.perf_counter())
        with self.lock:
            answer = self._answer(waiter) if self._may_proceed(waiter) else None
            if answer is None:
                self.waiting.append(waiter)
        if answer is not None:
            fut.set_result(answer)
        return fut

    def on_membership_change(self) -> None:
        """A worker left or died: rounds and staleness waits no longer wait for it."""
        with self.lock:
            if self.index == 0 and len(self.membership.dead) > self.deaths_seen:
                self.deaths_seen, self.note_next_update = len(self.membership.dead), True
            if self.rule is not None and self.rule.rounds:
                self._close_rounds()
            ready = self._ready_waiters()
        _complete(ready)

    # ------------------------------------------------------------------------------- under the lock

    def _apply_update(self, payload: Tensor, lr: float) -> None:
        start = time.perf_counter()
        assert self.rule is not None and self.params is not None
        if self.rule.averages:
            self.params.add_(payload)
        else:
            assert self.optimizer is not None  # initialize() makes one for every rule that does not average
            self.params.grad = payload
            self.optimizer.param_groups[0]["lr"] = lr
            self.optimizer.step()
            self.params.grad = None
        self.version += 1
        self.stats.updates += 1
        self.stats.update_seconds += time.perf_counter() - start
        if self.note_next_update:
            self.note_next_update = False
            log_event("resumed", version=self.version)

    def _expected(self, active: tuple[int, ...] | None) -> set[int]:
        alive = self.membership.alive()
        return alive if active is None else alive & set(active)

    def _close_rounds(self) -> None:
        """Apply every complete round, in step order (each needs the previous one applied)."""
        for key in sorted(self.rounds):
            rnd = self.rounds[key]
            if not self._expected(rnd.active) <= rnd.contributors:
                break
            del self.rounds[key]
            self._apply_update(rnd.total.div_(len(rnd.contributors)), rnd.lr)
            self.last_round = key

    def _may_proceed(self, w: Waiter) -> bool:
        if w.step is None or self.rule is None:
            return True
        if self.rule.rounds:
            return w.step == 0 or self.last_round >= (w.epoch, w.step - 1)
        bound = self.rule.staleness
        return bound is None or self._gap(w) <= bound

    def _gap(self, w: Waiter) -> int:
        """How many steps ``w.worker`` is ahead of the slowest other active live worker this epoch."""
        assert w.step is not None  # callers answer a step-less pull at once, without a gap
        others = [self._progress_in(j, w.epoch) for j in self._expected(w.active) if j != w.worker]
        return max(0, w.step - min(others)) if others else 0

    def _progress_in(self, worker: int, epoch: int) -> int:
        seen_epoch, count = self.progress.get(worker, (-1, 0))
        if seen_epoch == epoch:
            return count
        return 0 if seen_epoch < epoch else 1 << 30

    def _answer(self, w: Waiter) -> tuple[Tensor, int, float]:
        if self.rule is not None and not self.rule.rounds and w.step is not None:
            self.stats.clock_gap_max = max(self.stats.clock_gap_max, self._gap(w))
        assert self.params is not None, "pull() before initialize()"
        self.stats.bytes_out += self.params.numel() * self.params.element_size()
        return self.params.clone(), self.version, time.perf_counter() - w.since

    def _ready_waiters(self) -> list[tuple[Waiter, tuple]]:
        ready, still = [], []
        for w in self.waiting:
            if self._may_proceed(w):
                ready.append((w, self._answer(w)))
            else:
                still.append(w)
        self.waiting = still
        return ready


def _complete(ready: list[tuple[Waiter, tuple]]) -> None:
    for waiter, answer in ready:
        waiter.future.set_result(answer)
