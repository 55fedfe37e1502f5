"""The run folder: the contract that reports, benchmarks and later tools read.

- ``config.json``: the resolved configuration.
- ``metrics.jsonl``: one JSON object per finished epoch (its keys: ``record.K``, ``record.EPOCH_FIELDS`` in every row).
- ``summary.json``: the run's result (``record.K``; ``record.SUMMARY_FIELDS`` in every run), rewritten after every
  epoch, and once more after a fault-tolerant job with its fault records (``RunWriter.merge_summary``).
- ``run.toml``: the run's settings as `trainscale train --config` reads them (``write_run_toml``): ``--resume``
  takes them from here, and ``--config DIR/run.toml`` re-creates the run elsewhere.
- ``steps.jsonl``: one JSON object every ``--log-every`` steps (its keys: ``record.StepK``), appended as they come.
- ``tensorboard/``: the same figures and the epochs' as TensorBoard event files (``--tensorboard``).
- ``logs.tsv``: DAWNBench format: epoch, hours of training, top-1 test accuracy in percent.
- ``checkpoint.pt``: the last finished epoch (see ``checkpoint.py``).
- ``.lock``: held by the job writing the folder (see ``lock_run_folder``); readers ignore it.
Accuracies in the JSON files are fractions in 0..1; every file is replaced atomically. ``RunWriter`` is the one
writer of the two JSON files: producers hand it parts (dicts keyed by ``record.K``), it merges them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainscale.config import CoreConfig
from trainscale.errors import ConfigError
from trainscale.io import (
    append_jsonl,
    atomic_write_text,
    clean,
    dumps,
    missing_folders,
    open_output,
    open_regular,
    read_json,
    read_jsonl,
    remove_empty,
    to_toml,
)
from trainscale.record import (
    EPOCH_FIELDS,
    EXCHANGE_SPLIT,
    METRICS,
    RUN_TOML,
    STEPS,
    SUMMARY,
    SUMMARY_FIELDS,
    K,
    StepK,
    merge,
)

# Files a launcher of runs (``trainscale bench``) writes into a run folder before the run starts; a folder
# holding only these is still a new run's folder.
LAUNCHER_FILES = ("bench.json", RUN_TOML, "train.log", "error.txt")
# Settings about how this process was started, not what the run is: run.toml leaves them out (a run it re-creates
# starts fresh; ``--resume`` is given on the command line).
NOT_IN_RUN_TOML = ("resume", "dry_run")
PATH_SETTINGS = ("data_dir", "out", "hosts", "baseline")  # recorded absolute: run.toml is read from anywhere


def _absolute(key: str, value: Any) -> Any:
    return str(Path(value).expanduser().absolute()) if key in PATH_SETTINGS and isinstance(value, str) else value


TENSORBOARD_DIR = "tensorboard"
LOCK_FILE = ".lock"  # see lock_run_folder; a folder holding only this is a new run's folder too


class RunWriter:
    """Writes one run folder; only the main process owns one, or, where the folder is written in turns, each
    process that may be elected to write it (``shared``)."""

    def __init__(self, out: Path, clean: bool = True, tensorboard: bool = False, shared: bool = False) -> None:
        """``clean``: remove the debris of writes killed mid-way (see io.atomic_write_bytes); not where
        another process may be writing the folder now (a fault-tolerant job's replicas). ``tensorboard``: also
        write the step and epoch figures as TensorBoard events (the package must be installed). ``shared``: one
        of several processes that write the folder in turns, the one elected at an epoch's end writing it (a
        fault-tolerant job's replicas, a parameter-server job's node-0 workers); any of them may die at any
        moment and another take over, so the rows are kept as described at ``add_epoch``."""
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shared = shared
        self.history: list[dict[str, Any]] = []  # the rows as this process knows them (shared: its own too)
        self.tensorboard = tensorboard
        self._events: Any = None  # torch's SummaryWriter, made on first use
        self._purge_step: int | None = None
        self._steps_checked = False
        if clean:
            remove_debris(self.out)

    def write_run_toml(self, cfg: CoreConfig) -> None:
        """``run.toml``: every setting of ``cfg`` (``NOT_IN_RUN_TOML`` aside), one ``[section]`` table per config
        section, so `trainscale train --config` re-creates ``cfg`` exactly (a None is a default: left out)."""
        tables = {
            name: {k: _absolute(k, v) for k, v in section.to_dict().items() if k not in NOT_IN_RUN_TOML}
            for name, section in cfg.sections()
        }
        head = "# this run's settings: `trainscale train --config THIS_FILE --out NEW_DIR` trains it again\n"
        atomic_write_text(self.out / RUN_TOML, head + to_toml({}, tables))

    def add_steps(self, row: Mapping[str, Any]) -> None:
        """Append one ``steps.jsonl`` row (``record.StepK``), and its figures to the TensorBoard events."""
        line = clean(dict(row))
        if not self._steps_checked:  # the first append cuts a torn last line an interrupted run left
            append_jsonl(self.out / STEPS, line)
            self._steps_checked = True
        else:
            with open_output(self.out / STEPS, append=True) as f:
                f.write(dumps(line, indent=None).encode())
        for key in (StepK.loss, StepK.lr, StepK.samples_per_sec, StepK.step_seconds):
            self._scalar(f"step/{key}", row.get(key), row[StepK.step])

    def restore_steps(self, last_epoch: int) -> None:
        """On resume keep the step rows of the epochs the checkpoint covers (TensorBoard: drop later events)."""
        path = self.out / STEPS
        rows = [r for r in read_jsonl(path) if r[StepK.epoch] <= last_epoch] if path.exists() else []
        if path.exists():
            atomic_write_text(path, "".join(dumps(r, indent=None) for r in rows))
        self._steps_checked = True
        self._purge_step = (rows[-1][StepK.step] + 1) if rows else None

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if not self.tensorboard or value is None:
            return
        if self._events is None:
            from torch.utils.tensorboard import SummaryWriter  # an optional extra: imported only when asked for

            self._events = SummaryWriter(str(self.out / TENSORBOARD_DIR), purge_step=self._purge_step)
        self._events.add_scalar(tag, value, step)

    def close(self) -> None:
        """Flush and close the TensorBoard events (the JSON files are complete after each write)."""
        if self._events is not None:
            self._events.close()
            self._events = None

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.out / "config.json", dumps(config))

    def restore_history(self, last_epoch: int) -> None:
        """On resume keep the epochs the checkpoint covers and drop any written after it. A shared writer drops
        them from what it knows only, never from the folder: it may be a replica restarted into a running job,
        whose checkpoint is older than rows the live writers wrote since (rewriting the folder here dropped a row
        written as it resumed). Rows after its checkpoint that are stale (the whole job restarted) are replaced by
        the turns that write those epochs again (``add_epoch``)."""
        self.history = [r for r in read_history(self.out) if r[K.epoch] <= last_epoch]
        if not self.shared:
            self._write_history()

    def take_written(self, epoch: int) -> bool:
        """A shared writer elected for an epoch it trained none of (restarted, it healed from a peer just as the
        epoch ended): if the folder has that epoch's row, written by one that trained it, take the rows up to it as
        they are there instead of writing its own, and say so; False if there is none."""
        written = [r for r in read_history(self.out) if r[K.epoch] <= epoch]
        if epoch not in {r[K.epoch] for r in written}:
            return False
        self.history = written
        return True

    def keep_epoch(self, *parts: Mapping[str, Any]) -> dict[str, Any]:
        """An epoch's row that another process writes (it was elected): a shared writer keeps it, to write it
        at its own next turn should the one elected have died before its row was written; returns the row."""
        row = clean(merge(*parts, file=METRICS))
        self.history = [r for r in self.history if r[K.epoch] != row[K.epoch]] + [row]
        return row

    def adopt(self, rows: list[dict[str, Any]]) -> None:
        """The rows a peer knows, taken as this process heals from it (theirs win over its own): a shared
        writer restarted into a running job can then write an epoch that only the peer had kept."""
        known = {r[K.epoch]: r for r in self.history}
        known.update({r[K.epoch]: dict(r) for r in rows})
        self.history = [known[e] for e in sorted(known)]

    def add_epoch(self, *parts: Mapping[str, Any]) -> dict[str, Any]:
        """Append one epoch's row, merged from its producers' parts (``record.merge``); returns the row.

        A shared writer's turn: the epochs before this one as the folder has them now (written by whichever
        process was elected then), any that it lacks from this writer's own rows (``keep_epoch``: the one elected
        died before writing it), then this row; nothing after it (rows from before the whole job restarted from
        an older checkpoint, epochs it trains again). So each epoch is there once, in order, whoever wrote it."""
        row = clean(merge(*parts, file=METRICS))
        if self.shared:
            added = self._take_turn(row)
        else:
            self.history.append(row)
            added = [row]
        self._write_history()
        for new in added:
            for key in (K.train_loss, K.train_acc, K.test_loss, K.test_acc, K.lr, K.samples_per_sec):
                self._scalar(f"epoch/{key}", new.get(key), new[K.epoch])
        if self._events is not None:
            self._events.flush()
        return row

    def _take_turn(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """``history`` as a shared writer's turn writes it (see ``add_epoch``); returns the rows it adds to
        the folder's."""
        epoch = row[K.epoch]
        written = {r[K.epoch]: r for r in read_history(self.out) if r[K.epoch] < epoch}
        missing = [r for r in self.history if r[K.epoch] < epoch and r[K.epoch] not in written]
        rows = {**written, **{r[K.epoch]: r for r in missing}}
        self.history = [rows[e] for e in sorted(rows)] + [row]
        return missing + [row]

    def _write_history(self) -> None:
        lines = "".join(dumps(r, indent=None) for r in self.history)
        atomic_write_text(self.out / METRICS, lines)
        tsv = ["epoch\thours\ttop1Accuracy"] + [
            f"{r[K.epoch]}\t{r[K.elapsed_seconds] / 3600:.8f}\t{100 * r[K.test_acc]:.2f}"
            for r in self.history
            if r.get(K.test_acc) is not None  # an epoch without evaluation (--eval-every) has no accuracy to log
        ]
        atomic_write_text(self.out / "logs.tsv", "\n".join(tsv) + "\n")

    def write_summary(self, *parts: Mapping[str, Any]) -> dict[str, Any]:
        """Replace summary.json by the merge of ``parts`` (``record.merge``); returns what was written."""
        summary = merge(*parts, file=SUMMARY)
        atomic_write_text(self.out / SUMMARY, dumps(summary))
        return summary

    def merge_summary(self, *parts: Mapping[str, Any]) -> dict[str, Any]:
        """Add ``parts`` to the summary.json already there (a later producer's, e.g. the fault records a
        fault-tolerant launcher adds after the job), replaced atomically; returns what was written."""
        return self.write_summary(read_summary(self.out), *parts)


def remove_debris(out: Path) -> None:
    for debris in Path(out).glob(".*.tmp"):
        debris.unlink(missing_ok=True)


def in_use_message(out: Path, pid: int) -> str:
    """One line for a second job on ``out``: who holds it (when it recorded its pid) and what to do."""
    holder = f" (pid {pid})" if pid else ""
    return f"--out {out} is in use by another trainscale job{holder}; wait for it to finish or choose another --out"


@contextlib.contextmanager
def lock_run_folder(out: Path | None) -> Iterator[None]:
    """Hold the run folder's lock while a job writes it, so two jobs never mix their files in one folder
    (a second job, ``--resume`` included, gets a ConfigError naming the holder's pid).

    ``flock`` on ``<out>/.lock``: the kernel drops it when the holder exits however it dies, so a killed
    job leaves no stale lock, at most the file, which checks and readers ignore. On leaving, the file is
    removed while still locked, and the folder too (with the parents the lock made) if the job wrote nothing.
    ``None``: no folder (a launcher on node > 0).
    """
    if out is None:
        yield
        return
    out = Path(out)
    made = missing_folders(out)
    fd = _take_lock(out)
    try:
        yield
    finally:
        if fd is not None:
            _release(out, fd, made)


def _take_lock(out: Path) -> int | None:
    """The locked file's descriptor; None when the folder cannot be made or locked (the run-folder checks
    say why a folder cannot be written; a file system without locks runs unlocked)."""
    path = out / LOCK_FILE
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = open_regular(path, os.O_RDWR | os.O_CREAT, follow=False)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            pid = _recorded_pid(fd)
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise ConfigError(in_use_message(out, pid)) from None
            return None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # its holder removed it on leaving: lock the one there now


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _release(out: Path, fd: int, made: list[Path]) -> None:
    with contextlib.suppress(OSError):
        os.unlink(out / LOCK_FILE)
    remove_empty(made)  # only a job that wrote nothing leaves no folder (a parent shared with another job stays)
    os.close(fd)


def lock_holder(out: Path) -> int | None:
    """The pid of the process holding ``out``'s lock (0 while it has not written it yet), None when free.
    A shared probe, so checks running side by side do not see each other as holders."""
    try:
        fd = os.open(Path(out) / LOCK_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:  # absent, or not a lock file trainscale made (a symlink; a FIFO is opened, never waited on)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _recorded_pid(fd)
    finally:
        os.close(fd)


def _recorded_pid(fd: int) -> int:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else 0


def read_history(out: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of a run folder (a torn last line tolerated, see ``io.read_jsonl``)."""
    path = Path(out) / METRICS
    return read_jsonl(path) if path.exists() else []


def read_summary(out: Path) -> dict[str, Any]:
    """A run folder's summary.json (an error when it is missing or not JSON: callers check it is there)."""
    summary: dict[str, Any] = read_json(Path(out) / SUMMARY)
    return summary


__all__ = [
    "EPOCH_FIELDS",
    "EXCHANGE_SPLIT",
    "LAUNCHER_FILES",
    "LOCK_FILE",
    "SUMMARY_FIELDS",
    "RunWriter",
    "dumps",
    "lock_holder",
    "lock_run_folder",
    "read_history",
    "read_json",
    "read_summary",
]
