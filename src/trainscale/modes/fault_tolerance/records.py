"""A fault-tolerant job's fault record, from its replicas' fault log: per injected fault, detection, recovery and
the steps lost."""

from __future__ import annotations

from typing import Any


def fault_records(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per injected fault that fired: detection (the fault to the first survivor that saw it: a
    step not committed or a smaller quorum), recovery (the fault to the victim healed and back in the
    quorum), and the steps lost (steps the survivors did not commit in between, before the next fault)."""
    faults = [e for e in events if e["event"] == "fault"]
    records = []
    for i, fault in enumerate(faults):
        t0, victim = fault["time"], fault["rank"]
        until = faults[i + 1]["time"] if i + 1 < len(faults) else float("inf")
        later = [e for e in events if t0 <= e["time"] < until and e.get("replica") != victim]
        seen = next(
            (
                e
                for e in later
                if e["event"] == "aborted"
                or (e["event"] == "members" and e.get("members", 0) < members_before(events, t0))
            ),
            None,
        )
        healed = next(
            (e for e in events if e["time"] >= t0 and e["event"] == "healed" and e.get("replica") == victim), None
        )
        end = healed["time"] if healed else float("inf")
        lost = {e["step"] for e in later if e["event"] == "aborted" and e["time"] <= end}
        records.append(
            {
                "kind": fault["kind"],
                "rank": victim,
                "step": fault["step"],
                "detection_seconds": seen["time"] - t0 if seen else None,
                "recovery_seconds": healed["time"] - t0 if healed else None,
                "steps_lost": len(lost),
            }
        )
    return records


def members_before(events: list[dict[str, Any]], t0: float) -> int:
    counts = [e["members"] for e in events if e["event"] == "members" and e["time"] < t0]
    return counts[-1] if counts else 0
