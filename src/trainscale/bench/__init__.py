"""Benchmarks: timing helpers (``timing.py``) and the grid runner behind `trainscale bench`: a grid file
(``grid.py``) expands into runs (``expand.py``), each a `trainscale train` child process (``process.py``)
in its own run folder (``runfolder.py``), run one after another, resumably (``runner.py``).

The package itself imports nothing: a reader of grid files (``trainscale report``) imports ``grid`` without the
training stack that ``expand`` and ``runner`` bring.
"""
