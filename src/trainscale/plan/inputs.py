"""What a host's input pipeline delivers, measured for ``trainscale profile --input-data``: a user's dataset read
as training reads it (its torch Datasets through DataLoader worker processes), alone, in images per second.

The devices of one host share its CPUs, so a fast device can wait for its images: the plan takes this figure as
a floor under each host's step (``host_images_per_sec``). The profile measures one training process's loader;
a host of ``g`` training processes runs ``g`` such loaders on its cores, so it delivers the measured rate times
the loader processes it can run at once (``g`` x workers, at most its cores) over those the measurement ran (the
workers, at most the cores): linear in processes until the cores run out, an assumption the plan states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainscale.data.user import DatasetSplit, LoaderBatches, load_user_data
from trainscale.errors import ConfigError
from trainscale.registry import is_import_path


@dataclass(frozen=True)
class InputRate:
    """Images per second one training process's loader delivered with ``workers`` DataLoader processes on a
    machine of ``cores`` cores (or a CPU quota of that many)."""

    images_per_sec: float
    workers: int
    cores: float

    def host_rate(self, processes_per_host: int, host_cores: float) -> float:
        """What a host running ``processes_per_host`` such loaders on ``host_cores`` cores delivers."""
        ran = min(self.workers, self.cores)
        could = min(processes_per_host * self.workers, host_cores)
        return self.images_per_sec * max(could, 1) / max(ran, 1)


def check_input_data(path: str | None, workers: int) -> None:
    """One line for an input pipeline that cannot be timed, before anything is built."""
    if path is None:
        return
    if not is_import_path(path):
        raise ConfigError(
            f"--input-data {path!r}: give your dataset's import path (package.module:function); the built-in "
            "datasets are held in memory and augmented on the device, which the profile's data phase already times"
        )
    if workers < 1:
        raise ConfigError(
            "--input-data is timed with DataLoader workers running beside the step, as training runs them; "
            "with --loader-workers 0 the reading happens inside the step: give --loader-workers 1 or more"
        )


def measure_input(
    path: str, data_dir: str | None, workers: int, batch_size: int, count: int, cores: float
) -> InputRate:
    """``count`` batches of the training split of the dataset at ``path`` read with nothing else running, after
    one batch per worker and one more untimed (the workers' start-up, and the batches they read meanwhile)."""
    train, _ = load_user_data(path, data_dir)
    if not isinstance(train, DatasetSplit):
        raise ConfigError(
            f"--input-data {path} returns tensors: they are held in memory and augmented on the device, with no "
            "loader to time (the profile's data phase is their cost)"
        )
    batches = LoaderBatches(train, min(batch_size, len(train)), train=True, device="cpu", num_workers=workers)
    skip = workers + 1
    timed = min(count, len(batches) - skip)
    if timed < 2:
        raise ConfigError(
            f"--input-data {path}: {len(train)} training samples make {len(batches)} batch(es) of "
            f"{batches.batch_size}; timing with {workers} worker(s) needs {skip + 2}: give a smaller --batch-size"
        )
    loader = batches.epoch(0)
    try:
        for _ in range(skip):
            next(loader)
        start, images = time.perf_counter(), 0
        for _ in range(timed):
            images += len(next(loader)[0])
        elapsed = time.perf_counter() - start
    finally:
        getattr(loader, "close", lambda: None)()  # its DataLoader iterator, and with it the workers, end here
    return InputRate(images / elapsed, workers, cores)
