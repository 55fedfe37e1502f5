"""The optimizer registry (``registry``) and the optimizers registered in it, one file each."""

from trainscale.train.optim import lamb, lars, torch_builtin  # noqa: F401  (registration)
from trainscale.train.optim.registry import (
    OPTIMIZERS,
    check_optimizer,
    create_optimizer,
    list_optimizers,
    optimizer_info,
    register_optimizer,
)

__all__ = [
    "OPTIMIZERS",
    "check_optimizer",
    "create_optimizer",
    "list_optimizers",
    "optimizer_info",
    "register_optimizer",
]
