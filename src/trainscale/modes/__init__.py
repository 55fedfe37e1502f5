"""Training modes by name: local, sync (DDP), periodic averaging (localsgd, diloco) and the parameter-server
modes (async, ps-sync, ma).

Adding a mode: write its module (a ``Mode`` subclass decorated with ``@register_mode("name")``, listing
in ``sections`` the config sections it takes; its own section and checks in the same module if it has settings)
and add one import line below.
"""

from trainscale.modes import (
    localsgd,  # noqa: F401  (registers localsgd, diloco)
    ps,  # noqa: F401  (registers async, ps-sync, ma)
    sync,  # noqa: F401  (registers sync)
)
from trainscale.modes.base import MODES, Mode, create_mode, list_modes, mode_class, register_mode

__all__ = ["MODES", "Mode", "create_mode", "list_modes", "mode_class", "register_mode"]
