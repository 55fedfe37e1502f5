"""An optimizer a user writes, not registered with trainscale: given as ``--optimizer tests.userpkg.opt:Plain``."""

from __future__ import annotations

import torch


class Plain(torch.optim.SGD):
    """SGD under another name: what matters to the tests is where it is imported from."""
