"""The optimizer a parameter-server worker's training loop steps: ``train_one_epoch`` is unchanged.

``step()`` replaces the local update by the server's: ``async`` and ``ps-sync`` push the flat
gradient to every shard and pull the parameters back (the server's SGD, with momentum on the server,
does the update); ``ma`` takes a local SGD step (the wrapped optimizer, momentum local) and every
``average_every`` steps pushes the parameter change since the last average and pulls the new mean.
``param_groups`` are the trainer's (it sets the LR each step); the pushed LR is group 0's.
``state_dict()`` is the servers' state (parameters, momentum, version clocks), so the trainer's
per-epoch checkpoint holds it, written atomically with the rest, and ``load_state_dict`` (``--resume``)
puts it back on the servers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainscale.errors import ConfigError
from trainscale.modes.ps.client import ShardClient
from trainscale.modes.ps.server import Rule
from trainscale.modes.ps.shards import assign, flatten, gradients
from trainscale.runtime.dist import barrier, is_main_process
from trainscale.runtime.faults import InjectedFault
from trainscale.runtime.job import PS_SLOW_ENV

log = logging.getLogger("trainscale.ps")

SLOW_ENV = PS_SLOW_ENV  # TEST-ONLY: "worker=W:seconds=S" sleeps S before each step of worker W


@dataclass
class EpochClock:
    """The epoch the trainer runs next (the batches' length depends on it in warm-start epochs)."""

    next_epoch: int = 0


def rule_from(optimizer: torch.optim.Optimizer, name: str, staleness: int | None) -> Rule:
    """The server's update rule, from the local optimizer's hyperparameters (all groups must agree where the
    servers apply SGD; ``ma``'s servers only average, the workers' own optimizer steps)."""
    keys = ("momentum", "nesterov", "weight_decay", "dampening")
    groups = [{k: g.get(k, 0.0) for k in keys} for g in optimizer.param_groups]
    if any(g != groups[0] for g in groups[1:]) and not Rule(name).averages:
        raise ConfigError("parameter-server modes need one momentum/weight-decay setting for every parameter")
    g = groups[0]
    return Rule(
        name, float(g["momentum"]), bool(g["nesterov"]), float(g["weight_decay"]), float(g["dampening"]), staleness
    )


def injected_slowdown(worker: int, text: str) -> float:
    """Seconds worker ``worker`` sleeps before each step (test-only: ``text`` is the job's TRAINSCALE_PS_SLOW,
    ``Job.ps_slow``); 0 normally."""
    if not text:
        return 0.0
    try:
        fields = dict(part.split("=", 1) for part in text.split(":"))
        return float(fields["seconds"]) if int(fields["worker"]) == worker else 0.0
    except (KeyError, ValueError):
        raise ConfigError(f"{SLOW_ENV}='{text}': expected worker=W:seconds=S") from None


class PSOptimizer(torch.optim.Optimizer):
    """See the module docstring. ``local`` supplies the hyperparameters (and, for ``ma``, the steps)."""

    def __init__(
        self,
        local: torch.optim.Optimizer,
        client: ShardClient,
        rule: Rule,
        average_every: int,
        clock: EpochClock,
        slowdown_s: float = 0.0,
        fault: InjectedFault | None = None,
    ) -> None:
        super().__init__([dict(g) for g in local.param_groups], local.defaults)
        self.local = local
        self.client = client
        self.rule = rule
        self.average_every = average_every
        self.clock = clock
        self.slowdown_s = slowdown_s
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.since_average = 0
        self.anchor: torch.Tensor | None = None
        self.holding = False  # ma: no average in the middle of a hand-over share (see handover.py)
        self.fault = fault
        self.steps_taken = 0

    # ------------------------------------------------------------------------------ start and epochs

    def start(self) -> None:
        """The main worker seeds the servers with its parameters; then every worker pulls them."""
        if is_main_process():
            self.client.initialize(flatten(self.params), self.rule)
        self.sync_from_servers()

    def sync_from_servers(self) -> None:
        """After every worker has arrived, take the servers' parameters as they are."""
        barrier()
        flat = self.client.pull(wait=False)
        assign(self.params, flat.to(self.params[0].device))
        self.anchor = flat
        self.since_average = 0

    def end_epoch(self) -> None:
        """Model averaging folds in the steps since the last average; then all take the servers' values."""
        if self.rule.averages and self.since_average > 0:
            self._average()
        self.sync_from_servers()

    # ------------------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.slowdown_s:
            time.sleep(self.slowdown_s)
        self.steps_taken += 1
        if self.fault is not None and self.steps_taken == self.fault.step:
            # what dies with the worker: this step's gradient, and in ma the local steps since the last average
            self.fault.fire(steps_lost=self.since_average + 1 if self.rule.averages else 1)
        self.client.stats.steps += 1
        if self.rule.averages:
            self._local_step()
        else:
            self.client.push(gradients(self.params), self.param_groups[0]["lr"])
            assign(self.params, self.client.pull().to(self.params[0].device))
        return loss

    def _local_step(self) -> None:
        for mine, theirs in zip(self.local.param_groups, self.param_groups):
            mine["lr"] = theirs["lr"]
        self.local.step()
        self.since_average += 1
        if self.since_average >= self.average_every and not self.holding:
            self._average()

    def flush(self, active: tuple[int, ...] | None) -> None:
        """ma: push the local steps not averaged yet, in a round of ``active`` (None: the epoch's workers), so
        the servers hold them; the other rules push every step and have nothing to flush."""
        if self.rule.averages and self.since_average > 0:
            self.client.active = active
            self._average()

    def _average(self) -> None:
        current = flatten(self.params)
        assert self.anchor is not None  # set by start(), which comes before any step
        self.client.push(current - self.anchor, self.param_groups[0]["lr"])
        self.anchor = self.client.pull()
        assign(self.params, self.anchor.to(self.params[0].device))
        self.since_average = 0

    # ------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The servers' state (called on the main worker when the trainer checkpoints)."""
        state: dict[str, Any] = {
            "servers": self.client.fetch_state(),
            "next_epoch": self.clock.next_epoch,
            "rule": self.rule.name,
        }
        if self.rule.averages:
            state["local"] = self.local.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``--resume`` (every worker calls this): the main worker restores the servers, all pull."""
        if state.get("rule") != self.rule.name:
            raise ConfigError(
                f"--resume: the checkpoint was written by --mode {state.get('rule')}, this run is "
                f"--mode {self.rule.name}"
            )
        if is_main_process():
            self.client.restore(state["servers"])
        if self.rule.averages and "local" in state:
            self.local.load_state_dict(state["local"])
        self.clock.next_epoch = int(state["next_epoch"])
        self.sync_from_servers()
