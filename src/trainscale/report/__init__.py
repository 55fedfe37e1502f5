"""Tables and reports built from run folders: console tables (``console.py``) and `trainscale report`
(``collect`` the runs, ``aggregate`` repeats per environment, ``tables``/``csvfile``/``plots``/``html``
render them, ``build`` writes the report folder)."""
