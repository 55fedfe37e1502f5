"""`trainscale train --fault-tolerance` from the launcher's side, and the fault records a job adds to its summary.

The launcher of a fault-tolerant job is ``modes.fault_tolerance.launcher``; after it, the launcher turns the
replicas' event log into ``summary.json``'s ``faults`` (one object per injected fault: detection and recovery
seconds, steps lost) and ``replicas_equal`` (whether every replica ended with bitwise-equal parameters and
buffers). A parameter-server job's ``faults`` are recorded the same way (``modes.ps.faults``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainscale.modes.fault_tolerance.launcher import DEFAULT_RESTARTS, Meeting, run_replicas
from trainscale.modes.fault_tolerance.records import fault_records
from trainscale.modes.ps.faults import ps_fault_record
from trainscale.record import SUMMARY, K
from trainscale.results import RunWriter, remove_debris
from trainscale.runtime import ft
from trainscale.runtime.faults import InjectedFault, injected_faults

__all__ = ["DEFAULT_RESTARTS", "Meeting", "fault_records", "launch_replicas", "record_faults", "record_ps_faults"]

log = logging.getLogger("trainscale.launch")


def launch_replicas(cfg: Any, argv: list[str], out: Path | None, meeting: Meeting) -> int:
    """Run this node's replicas to the end (``run_replicas``); returns the job's exit status. On node 0 (``out``,
    the run folder) a finished job's faults are then added to its summary."""
    status = run_replicas(cfg, argv, out, meeting)
    if out is None:
        return status
    remove_debris(out)  # of a replica killed while writing
    if status == 0 and (out / SUMMARY).exists():
        record_faults(out, out / ft.EVENTS_FILE, injected_faults(cfg.faults))
    return status


def record_faults(out: Path, events_path: Path, injected: list[InjectedFault]) -> None:
    """Add ``faults``, ``replicas_equal`` and ``replicas_finished`` to summary.json, through its writer."""
    events = ft.read_events(events_path)
    faults = fault_records(events)
    fired = {(f["kind"], f["rank"], f["step"]) for f in faults}
    for fault in injected:
        if (fault.kind, fault.rank, fault.step) not in fired:
            log.warning(
                "--inject-fault %s:%d@%d never fired: the job ended at step %s",
                fault.kind,
                fault.rank,
                fault.step,
                max((e["step"] for e in events if e["event"] == "final"), default="?"),
            )
    digests = {e["replica"]: e["digest"] for e in events if e["event"] == "final"}
    RunWriter(out, clean=False).merge_summary(
        {
            K.faults: faults,
            K.replicas_equal: len(set(digests.values())) == 1 if digests else None,
            K.replicas_finished: len(digests),
        }
    )


def record_ps_faults(out: Path, injected: list[InjectedFault]) -> None:
    """A parameter-server job's ``faults`` in summary.json (through its writer), from its fault log: per
    injected fault, detection (the fault to the first server that dropped the worker), recovery (the fault to
    the first update the servers applied after that: the job going on without it; workers are not
    restarted), the steps lost (the victim's steps no push committed) and whether its batches were handed over."""
    events = ft.read_events(out / ft.EVENTS_FILE)
    fired = [e for e in events if e["event"] == "fault"]
    if not injected and not fired:
        return
    RunWriter(out, clean=False).merge_summary({K.faults: [ps_fault_record(fault, events) for fault in fired]})
    if len(fired) < len(injected):
        log.warning("%d --inject-fault fault(s) never fired: the job ended first", len(injected) - len(fired))
