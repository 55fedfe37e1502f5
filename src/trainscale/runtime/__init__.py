"""Everything that talks to torch.distributed lives here; the rest of trainscale calls these helpers
(``runtime.dist``: rank 0 of a world of 1 when no process group exists).

The package itself imports nothing: the commands that only drive processes and namespaces (``cluster``,
``report``, ``plan`` from figures) import its non-torch modules without loading torch.
"""
