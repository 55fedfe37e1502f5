"""A parameter-server job's fault record, from its fault log: per injected fault, detection, recovery, the steps
lost and whether its batches were handed over."""

from __future__ import annotations

from typing import Any


def ps_fault_record(fault: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    if fault.get("server"):
        return server_fault_record(fault, events)
    t0, victim = fault["time"], fault["rank"]
    dead = next((e for e in events if e["event"] == "dead" and e["worker"] == victim and e["time"] >= t0), None)
    resumed = next((e for e in events if e["event"] == "resumed" and dead and e["time"] >= dead["time"]), None)
    handed = [e for e in events if e["event"] == "handover" and victim in e["owners"] and e["time"] >= t0]
    return {
        "kind": fault["kind"],
        "rank": victim,
        "step": fault["step"],
        "detection_seconds": dead["time"] - t0 if dead else None,
        "recovery_seconds": resumed["time"] - t0 if resumed else None,
        "steps_lost": fault.get("steps_lost"),
        "handed_over": bool(handed),
    }


def server_fault_record(fault: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """A killed server shard: detection (the fault to the first worker that lost it), recovery (to the shard
    restored from the last epoch's checkpoint in the restarted job, or back at all when the job restarted before
    its first checkpoint; None without ``--max-restarts``) and the steps lost, counted in the shard's updates (those
    it had applied since that checkpoint)."""
    t0, shard = fault["time"], fault["rank"]
    lost = next((e for e in events if e["event"] == "server_lost" and e["time"] >= t0), None)
    back = [e for e in events if e["event"] in ("restored", "restarted") and e["shard"] == shard and e["time"] >= t0]
    restored = next((e for e in back if e["event"] == "restored"), back[0] if back else None)
    return {
        "kind": fault["kind"],
        "rank": shard,
        "server": True,
        "step": fault["step"],
        "detection_seconds": lost["time"] - t0 if lost else None,
        "recovery_seconds": restored["time"] - t0 if restored else None,
        "steps_lost": fault["version"] - restored.get("version", 0) if restored else None,
        "handed_over": False,
    }
