"""benchmarks/chaos.py's pure parts: where the faults go and how the run is judged."""

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("chaos", Path(__file__).parents[2] / "benchmarks" / "chaos.py")
chaos = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(chaos)


def test_faults_go_every_t_seconds_at_the_fault_free_step_rate():
    faults = chaos.schedule(steps=600, seconds=300.0, every=60.0, workers=4, kinds=["kill", "hang"], seed=3)
    steps = [int(f.rsplit("@", 1)[1]) for f in faults]
    assert steps == [120, 240, 360, 480]  # 2 steps/s; none in the last 30 s
    assert all(f.split(":")[0] in ("kill", "hang") and 0 <= int(f.split(":")[1].split("@")[0]) < 4 for f in faults)
    assert faults == chaos.schedule(600, 300.0, 60.0, 4, ["kill", "hang"], seed=3)  # the seed decides


def test_link_cuts_never_take_host_0():
    """Replica 0's host serves the lighthouse: every cut goes to another replica's host."""
    faults = chaos.schedule(steps=6000, seconds=3000.0, every=10.0, workers=4, kinds=["link"], seed=0)
    assert len(faults) > 200 and {int(f.split(":")[1].split("@")[0]) for f in faults} == {1, 2, 3}


def fault(steps_lost=1, detection=0.5, recovery=8.0):
    return {
        "kind": "kill",
        "rank": 1,
        "step": 5,
        "steps_lost": steps_lost,
        "detection_seconds": detection,
        "recovery_seconds": recovery,
    }


@pytest.mark.parametrize(
    "faults, kept, equal, met",
    [
        ([fault(), fault(detection=1.9)], 0.9, True, True),
        ([fault(steps_lost=2)], 0.9, True, False),
        ([fault(detection=2.5)], 0.9, True, False),
        ([fault(recovery=None)], 0.9, True, False),  # never healed
        ([fault()], 0.8, True, False),
        ([fault()], 0.9, False, False),
        ([], 1.0, True, False),  # nothing was tested
    ],
)
def test_the_goals(faults, kept, equal, met):
    assert chaos.verdict(faults, kept, equal)["goals_met"] is met


@pytest.mark.parametrize(
    "mode, lost, skipped, met",
    [
        ("async", 1, 0, True),
        ("async", 2, 0, False),
        ("ma", 2, 0, True),  # ma loses the local steps since its last average: up to its period (4 by default)
        ("ma", 5, 0, False),
        ("ps-sync", 1, 3, False),  # a batch no push committed
    ],
)
def test_the_parameter_server_goals(mode, lost, skipped, met):
    result = chaos.ps_verdict([fault(steps_lost=lost)], 0.9, skipped, {"mode": mode})
    assert result["goals_met"] is met and result["batches_skipped"] == skipped
