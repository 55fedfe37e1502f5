"""Every writer refuses a path that exists and is not a regular file, and never renames over one.

The special files are made here, in ``tmp_path``: a character device node (root can make one; the same
numbers as /dev/null, but a node of the test's own), a FIFO, a folder, and symlinks to them. A writer
that opened a FIFO for writing would wait for a reader forever: the FIFO tests run under pytest-timeout.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from trainscale.errors import ConfigError
from trainscale.io import append_jsonl, atomic_write_text, check_output, open_output, save_figure

pytestmark = pytest.mark.timeout(60)


def char_device(path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def folder(path: Path) -> Path:
    path.mkdir()
    return path


def symlink_to_fifo(path: Path) -> Path:
    os.mkfifo(path.with_name("elsewhere"))
    path.symlink_to(path.with_name("elsewhere"))
    return path


SPECIAL: dict[str, Callable[[Path], Path]] = {
    "char device": char_device,
    "fifo": fifo,
    "folder": folder,
    "symlink to a fifo": symlink_to_fifo,
}


@pytest.fixture(params=list(SPECIAL))
def special(request, tmp_path) -> Path:
    """A special file named like an output, its kind recorded so the test can check it is still there."""
    path = SPECIAL[request.param](tmp_path / "out.file")
    return path


def unchanged(path: Path, before: os.stat_result) -> bool:
    now = os.lstat(path)
    return (now.st_ino, stat.S_IFMT(now.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))


def refuses(special: Path, write: Callable[[Path], object]) -> None:
    before = os.lstat(special)
    with pytest.raises(ConfigError, match="not a regular file"):
        write(special)
    assert unchanged(special, before)
    assert [p.name for p in special.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_atomic_write_refuses_and_never_renames_over(special):
    refuses(special, lambda p: atomic_write_text(p, "x"))


def test_append_refuses_without_waiting_on_a_fifo(special):
    refuses(special, lambda p: append_jsonl(p, {"a": 1}))


def test_streamed_log_refuses(special):
    refuses(special, lambda p: open_output(p))


def test_figure_refuses(special):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    try:
        refuses(special, lambda p: save_figure(fig, p))
    finally:
        plt.close(fig)


def test_run_folder_files_refuse(tmp_path):
    from trainscale.results import RunWriter

    writer = RunWriter(tmp_path)
    fifo(tmp_path / "summary.json")
    refuses(tmp_path / "summary.json", lambda p: writer.write_summary({"epochs": 1}))
    fifo(tmp_path / "metrics.jsonl")
    refuses(tmp_path / "metrics.jsonl", lambda p: writer.add_epoch({"epoch": 1}))


def test_checkpoint_refuses(tmp_path):
    from trainscale.train.checkpoint import save_checkpoint

    refuses(fifo(tmp_path / "checkpoint.pt"), lambda p: save_checkpoint(p, {"epoch": 1}))


def test_report_csv_refuses(tmp_path):
    from trainscale.report.csvfile import write_csv

    refuses(fifo(tmp_path / "results.csv"), lambda p: write_csv(p, [{"run": "a"}]))


def test_bench_run_files_refuse(tmp_path):
    from trainscale.bench import runfolder

    class Spec:
        run_id, config = "r1", {"epochs": 1}

        def record(self) -> dict[str, object]:
            return {"run_id": "r1"}

    refuses(fifo(tmp_path / runfolder.MARKER), lambda p: runfolder.write_run_files(tmp_path, Spec(), False))


def test_download_refuses_a_fifo_as_its_partial_file(tmp_path):
    from trainscale.data.download import fetch_url

    source = tmp_path / "archive.tar.gz"
    source.write_bytes(b"data")
    refuses(fifo(tmp_path / "archive.part"), lambda p: fetch_url(source.as_uri(), p, progress=False))


def test_fault_log_refuses(tmp_path):
    from trainscale.runtime import ft
    from trainscale.runtime.job import Job, installed

    log = fifo(tmp_path / "events.jsonl")
    with installed(Job(fault_log=log)):  # the job's fault log, as the entry installs it
        refuses(log, lambda p: ft.log_event("test"))


def test_run_folder_lock_is_never_a_symlink(tmp_path):
    """The lock file is truncated and written in place: a symlink planted in its place must not lead that
    write to another file."""
    from trainscale.results import lock_holder, lock_run_folder

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    out = folder(tmp_path / "run")
    (out / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match="symlink"), lock_run_folder(out):
        pass
    assert victim.read_text() == "keep me"
    (out / ".lock").unlink()
    fifo(out / ".lock")
    assert lock_holder(out) is None  # a FIFO is looked at, never waited on
    with pytest.raises(ConfigError, match="FIFO"), lock_run_folder(out):
        pass


def test_symlink_to_a_file_is_written_through_keeping_mode(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_new_files_follow_the_umask_not_mkstemp(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", json.dumps({}))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644


def test_check_output_names_the_kind_and_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--plot .* is a FIFO, not a regular file"):
        check_output(fifo(tmp_path / "p.png"), "--plot")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        check_output(tmp_path / "file" / "p.png", "--plot")


def test_download_never_renames_over_a_special_archive_path(tmp_path):
    from trainscale.data.checksums import FORMATS
    from trainscale.data.download import download_dataset

    archive = fifo(tmp_path / FORMATS["cifar10-binary"].archive)
    refuses(archive, lambda p: download_dataset("cifar10", tmp_path, url=(tmp_path / "none").as_uri(), progress=False))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_dry_run_refuses_a_folder_that_takes_no_files_and_leaves_nothing(tmp_path, capsys):
    """Permissions alone pass root on /proc (before, `--out /proc/x --dry-run` said all was well and the run was
    then refused); the dry run's probe file has no name, so a folder it accepts is left as it was."""
    from trainscale.cli import main

    assert main(["train", "--out", "/proc/x", "--dry-run", "--dataset", "synthetic"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("trainscale train: error: --out /proc/x: cannot write there ("), err
    assert main(["train", "--out", str(tmp_path / "a" / "b"), "--dry-run", "--dataset", "synthetic"]) == 0
    assert not list(tmp_path.iterdir())


def test_profile_and_plot_outputs_replace_only_a_file_of_their_own_kind(tmp_path):
    """`profile --out` over a run's checkpoint.pt replaced 13.6 MB of weights with a profile, and `plan --plot`
    over a text file named mine.png replaced it with a figure, in silence."""
    from trainscale.errors import ConfigError
    from trainscale.io import check_replaceable
    from trainscale.plan.cli import check_plot, is_figure
    from trainscale.plan.profile import FORMAT, is_profile

    checkpoint, notes, profile = tmp_path / "checkpoint.pt", tmp_path / "mine.png", tmp_path / "p.json"
    checkpoint.write_bytes(b"PK\x03\x04" + bytes(64))
    notes.write_text("my notes\n")
    profile.write_text(f'{{"format": "{FORMAT}", "model": "mlp"}}\n')
    for path in (checkpoint, notes):
        with pytest.raises(ConfigError, match=f"^--out {path} holds a file that is not a trainscale profile"):
            check_replaceable(path, "--out", "a trainscale profile", is_profile)
    check_replaceable(profile, "--out", "a trainscale profile", is_profile)  # a profile: replaced
    check_replaceable(tmp_path / "new.json", "--out", "a trainscale profile", is_profile)  # nothing there yet
    with pytest.raises(ConfigError, match=f"^--plot {notes} holds a file that is not a figure"):
        check_plot(notes)
    notes.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    assert is_figure(notes)
    check_plot(notes)
