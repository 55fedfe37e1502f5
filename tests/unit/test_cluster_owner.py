"""A cluster's owner: one lock per cluster name (``cluster.owner``), without root: the lock folder is a temporary
one. Another process holding the lock is a second open file description with an flock, as the kernel sees it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainscale.cluster import owner as owners


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(owners, "LOCK_DIR", tmp_path / "locks")
    monkeypatch.setattr(owners, "WAIT_S", 0.2)
    return tmp_path / "locks"


@pytest.fixture
def held_elsewhere(lock_dir: Path) -> Iterator[int]:
    """Cluster ``other``'s lock held as another process holds it, with that process's pid (1) written in."""
    lock_dir.mkdir()
    fd = os.open(lock_dir / "other.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"1\n")
    yield fd
    os.close(fd)


def test_a_held_lock_refuses_naming_its_holder(held_elsewhere: int) -> None:
    assert owners.holder("other") == owners.Owner(1, owners.net.command_of(1))
    with pytest.raises(owners.ClusterBusy, match=r"^cluster other is in use by pid 1\b.*down other --force"):
        with owners.owned("other"):
            pass
    assert (owners.LOCK_DIR / "other.lock").exists()  # the holder's file is not touched


def test_the_lock_is_taken_let_go_and_its_file_removed(lock_dir: Path) -> None:
    assert owners.holder("c1") is None
    with owners.owned("c1"):
        assert owners.holds("c1")
        assert (lock_dir / "c1.lock").read_text() == f"{os.getpid()}\n"
        assert owners.holder("c1") == owners.Owner(os.getpid(), owners.net.command_of(os.getpid()))
        with pytest.raises(owners.ClusterBusy, match=f"pid {os.getpid()}"):  # not re-entrant
            with owners.owned("c1"):
                pass
    assert not owners.holds("c1") and not (lock_dir / "c1.lock").exists() and owners.holder("c1") is None


def test_a_killed_holders_file_is_taken_over(lock_dir: Path) -> None:
    """A lock file whose holder died (nobody has it locked, a dead pid inside) is a leftover, not an owner."""
    lock_dir.mkdir()
    (lock_dir / "c2.lock").write_text("999999999\n")
    assert owners.holder("c2") is None and owners.leftover_locks() == ["c2"]
    with owners.owned("c2"):
        assert (lock_dir / "c2.lock").read_text() == f"{os.getpid()}\n"
    assert owners.leftover_locks() == []


def test_clearing_a_leftover_removes_a_killed_holders_file_and_never_makes_one(
    lock_dir: Path, held_elsewhere: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cluster down --all` and the tests clear killed owners' lock files: one that a live owner deleted meanwhile
    (the sweep listed it just before) is not put back, not even for a moment, and a held one is left to its
    holder."""
    real_open, flags = owners.open_regular, []
    monkeypatch.setattr(
        owners, "open_regular", lambda path, f, follow=True: flags.append(f) or real_open(path, f, follow)
    )
    assert owners.clear_leftover("gone") and not (lock_dir / "gone.lock").exists()
    assert flags and not any(f & os.O_CREAT for f in flags)
    (lock_dir / "c5.lock").write_text("999999999\n")
    assert owners.clear_leftover("c5") and not (lock_dir / "c5.lock").exists()
    assert not owners.clear_leftover("other", wait_s=0) and (lock_dir / "other.lock").exists()


def test_a_file_removed_after_it_was_opened_is_not_a_lock(lock_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous holder deleted its file between our open and our flock: locking that file would give two
    owners (the next process locks a new file), so the new file is locked instead."""
    lock_dir.mkdir()
    real_open = owners.open_regular
    opened: list[int] = []

    def open_then_replaced(path: Path, flags: int, follow: bool = True) -> int:
        fd = real_open(path, flags, follow)
        if not opened:  # the first open: the holder lets go and removes the file right after it
            path.unlink()
        opened.append(fd)
        return fd

    monkeypatch.setattr(owners, "open_regular", open_then_replaced)
    with owners.owned("c3"):
        assert len(opened) == 2
        assert os.fstat(owners._held["c3"]).st_ino == (lock_dir / "c3.lock").stat().st_ino


def test_changing_a_cluster_needs_its_lock() -> None:
    with pytest.raises(RuntimeError, match="without its lock"):
        owners.require("c4")
    with owners.owned("c4"):
        owners.require("c4")


def test_only_a_trainscale_owner_is_ever_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[list[int]] = []
    monkeypatch.setattr(owners.net, "stop_processes", lambda pids, grace_s: stopped.append(list(pids)))
    owners.stop_owner(owners.Owner(1, ""))  # pid 1 is init, not trainscale: left alone
    owners.stop_owner(owners.Owner(0, ""))
    owners.stop_owner(owners.Owner(os.getpid(), ""))
    assert stopped == []


def test_ancestors_are_the_parent_chain() -> None:
    assert owners.is_ancestor(os.getpid()) and owners.is_ancestor(os.getppid()) and owners.is_ancestor(1)
    assert not owners.is_ancestor(0) and not owners.is_ancestor(2**22 + 1)
