"""What the workers of a launched job start with: their command line (the parent's `train` flags, with the
resolved run folder) and the environment the agent hands them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainscale.app.config import TrainConfig
from trainscale.config import flag_name
from trainscale.modes import mode_class
from trainscale.registry import import_root, is_import_path
from trainscale.runtime import ft
from trainscale.runtime.faults import InjectedFault, injected_faults, on_cluster
from trainscale.runtime.job import this_job


def to_argv(flags: dict[str, Any]) -> list[str]:
    """Parsed `train` flags back to command-line form (switches as --x/--no-x, lists comma-joined, KEY=VALUE
    lists one item after another)."""
    fields = TrainConfig.field_map()
    argv: list[str] = []
    for key, value in flags.items():
        field = fields[key][1] if key in fields else None
        name = flag_name(field) if field is not None else "--" + key.replace("_", "-")
        if field is not None and field.metadata.get("pairs"):
            argv += [name, *value] if value else []
        elif isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, (list, tuple)):
            argv += [name, ",".join(map(str, value))]
        else:
            argv += [name, str(value)]
    return argv


def train_argv(flags: dict[str, Any], out: Path | None) -> list[str]:
    """A worker's `trainscale` command line: the same `train` flags, with the resolved run folder ``out``."""
    overrides = {"out": str(out)} if out is not None else {}
    return ["train", *to_argv({**flags, **overrides})]


def worker_args(flags: dict[str, Any], out: Path | None) -> list[str]:
    """Arguments after ``sys.executable`` for a worker that is a new interpreter (``train_argv``)."""
    return ["-u", "-m", "trainscale", *train_argv(flags, out)]


def worker_env(cfg: TrainConfig, threads: int, fault_log: Path | None) -> dict[str, str]:
    """Variables for the agent (this process) and the workers it starts (they inherit its environment).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default torch's agent hands its rendezvous store to the
    workers and keeps it across restarts; restarted workers then find the dead ones' keys (gloo
    addresses, init counters) and fail with "Connection refused" or hang in init_process_group (seen
    here in 2 of 5 restarts). Unshared, each rendezvous round gets a fresh store on a fresh port,
    the same on every node. (``process_group.attempt_store`` covers an external torchrun on one node.)

    TORCH_CPP_LOG_LEVEL=ERROR in parameter-server jobs (unless already set): RPC shuts down locally
    (see ``process_group.rpc_session``), and TensorPipe logs a C++ warning on every peer for every
    connection that closes, a screenful at each normal exit. The PS reports dead peers itself.
    """
    env = {"OMP_NUM_THREADS": str(threads), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if mode_class(cfg.run.mode).uses_servers and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    if fault_log is not None:  # a parameter-server job's faults, deaths and hand-overs
        env[ft.EVENTS_ENV] = str(fault_log / ft.EVENTS_FILE)
    if cfg.launch.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.launch.devices))
    return env


def user_code_env(cfg: TrainConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH for the processes a launcher starts, so they import a model, dataset or optimizer given by
    import path from where this process did: the folder its top-level package was found in (a ``sys.path`` entry a
    script or notebook may have added) and the current folder (which ``python -m trainscale`` searches), ahead of
    the PYTHONPATH already set. Empty when the job names no import path or the folders are there already."""
    environ = dict(os.environ) if environ is None else environ
    paths = [p for p in (cfg.data.model, cfg.data.dataset, cfg.optim.optimizer) if is_import_path(p)]
    if not paths:
        return {}
    present = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    roots = [os.getcwd(), *(r for r in map(import_root, paths) if r is not None)]
    missing = [r for r in dict.fromkeys(roots) if r not in present]
    if not missing:
        return {}
    return {"PYTHONPATH": os.pathsep.join([*missing, *present])}


@contextlib.contextmanager
def fault_log_folder(cfg: TrainConfig, out: Path | None) -> Iterator[Path | None]:
    """Where this node's parameter-server processes log faults, deaths and hand-overs (None in other modes): node
    0's run folder ``out``; on an emulated cluster, whose hosts share one file system, every node's (the same
    ``--out``). On the other nodes of a job across real machines, a folder of this launcher's, removed with it: the
    run's summary does not see their faults (another node's folder of that name is not the run's), but a restarted
    attempt there still knows which of its injected faults fired already (``runtime.faults.not_yet_fired``)."""
    if not mode_class(cfg.run.mode).uses_servers:
        yield None
    elif out is not None:
        yield out
    elif cfg.run.out and on_cluster(this_job()):
        yield Path(cfg.run.out)
    else:
        with tempfile.TemporaryDirectory(prefix="trainscale-faults-") as folder:
            yield Path(folder)


def logged_faults(cfg: TrainConfig) -> list[InjectedFault]:
    """The injected faults whose firing node 0's fault log is sure to record (for its "never fired" warning):
    all of them where the nodes share it (one machine, an emulated cluster); none across real machines, where
    the rendezvous decides which machine runs which worker and shard (``fault_log_folder``)."""
    return injected_faults(cfg.faults) if cfg.launch.nnodes == 1 or on_cluster(this_job()) else []
