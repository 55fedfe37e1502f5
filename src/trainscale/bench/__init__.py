"""Benchmarks: timing helpers (``timing.py``) and the grid runner behind `trainscale bench`: a grid file
(``grid.py``) expands into runs (``expand.py``), each a `trainscale train` child process (``process.py``)
in its own run folder (``runfolder.py``), run one after another, resumably (``runner.py``)."""

from trainscale.bench.expand import RunSpec, config_hash, plan_runs
from trainscale.bench.grid import Grid, GridError, load_grid
from trainscale.bench.runner import BenchOptions, RunResult, run_grid

__all__ = [
    "BenchOptions",
    "Grid",
    "GridError",
    "RunResult",
    "RunSpec",
    "config_hash",
    "load_grid",
    "plan_runs",
    "run_grid",
]
