"""`trainscale report`: ``collect`` the runs of grid and run folders, ``aggregate`` repeats per environment,
render them as ``tables``, ``csvfile``, ``plots`` and ``html`` (both renderers read the ``document``); ``build``
writes the report folder."""
