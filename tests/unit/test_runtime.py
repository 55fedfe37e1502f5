"""The collective helpers: no-ops for a process that is alone, an error for one that should be in a group.
Processes that end with their job (``runtime.orphans``), and the run folder's lock (``results.lock_run_folder``)."""

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainscale.errors import ConfigError
from trainscale.results import LOCK_FILE, lock_holder, lock_run_folder
from trainscale.runtime.dist import (
    NoProcessGroup,
    all_reduce_sum,
    barrier,
    broadcast_object,
    is_main_process,
    job_restarted,
    rank,
    world_size,
)
from trainscale.train.setup import check_run_folder


def test_helpers_are_no_ops_at_world_size_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    values = torch.tensor([1.0, 2.0])
    assert torch.equal(all_reduce_sum(values), values)
    assert (rank(), world_size(), is_main_process(), broadcast_object("x")) == (0, 1, True, "x")
    barrier()


@pytest.mark.parametrize("count, restarted", [(None, False), ("", False), ("0", False), ("2", True)])
def test_alone_a_process_has_restarted_when_its_agent_says_so(monkeypatch, count, restarted):
    monkeypatch.setenv("WORLD_SIZE", "1")
    if count is None:
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
    assert job_restarted() is restarted


@pytest.mark.parametrize(
    "call",
    [
        lambda: all_reduce_sum(torch.ones(1)),
        world_size,
        rank,
        barrier,
        lambda: broadcast_object(1),
        is_main_process,
        job_restarted,
    ],
)
def test_helpers_raise_when_the_launcher_says_distributed_but_no_group_exists(monkeypatch, call):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(NoProcessGroup, match="WORLD_SIZE=4 says this process is one of 4"):
        call()


GROUP_LIFETIME = """
import os, time, torch
from torch import nn
from trainscale.runtime.network import free_port
from trainscale.runtime.process_group import process_group
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
GLOO = {"pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"}
def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
def settled(done):  # a thread names itself once it runs, and ends a moment after it is told to
    deadline = time.monotonic() + 10
    while not done(set(threads())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return threads()
with process_group(torch.device("cpu"), "gloo", timeout_s=30):
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    print(settled(lambda names: {"pt_gloo_runloop", "gloo_tcp_loop"} <= names))
print(settled(lambda names: not GLOO & names))
"""


def test_leaving_the_process_group_frees_it_after_an_optimizer_step():
    """A group that outlives its ``with`` is freed at interpreter exit, where gloo's threads abort the worker
    (SIGABRT). A fresh interpreter, because the first optimizer step is what used to pin it (torch._dynamo's
    first import)."""
    result = subprocess.run([sys.executable, "-c", GROUP_LIFETIME], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    inside, after = (ast.literal_eval(line) for line in result.stdout.splitlines()[-2:])
    assert "pt_gloo_runloop" in inside and "gloo_tcp_loop" in inside
    assert not {"pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"} & set(after), after


AVERAGE = """
import os, sys, torch
from trainscale.runtime.dist import average_in_place, broadcast_tensors
from trainscale.runtime.process_group import process_group
rank = int(sys.argv[1])
os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
with process_group(torch.device("cpu"), "gloo", timeout_s=60):
    a, b = torch.full((2, 2), float(rank)), torch.tensor([3.0 * rank, 1.0], dtype=torch.float64)
    average_in_place([a, b])
    c = torch.tensor([float(rank + 1)])
    broadcast_tensors([c], src=1)
    print(a.tolist(), b.tolist(), c.tolist())
"""


def test_average_in_place_and_broadcast_tensors_across_two_ranks():
    from trainscale.runtime.network import free_port

    port = str(free_port())
    procs = [python(AVERAGE, str(r), port) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for out, _ in outs:
        assert out.strip().splitlines()[-1] == "[[0.5, 0.5], [0.5, 0.5]] [1.5, 1.0] [2.0]"


# ------------------------------------------------------------------ processes end with their job (runtime.orphans)


def python(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def gone(pid: int, timeout: float) -> bool:
    """True once ``pid`` has ended (a zombie counts: its new parent may never reap it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
from trainscale.runtime.orphans import die_with_parent
die_with_parent(parent=int(sys.argv[1]))
print(os.getpid(), flush=True)
time.sleep(60)
''', str(os.getpid())], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_child_dies_with_its_parent_killed_by_sigkill():
    parent = python(ORPHAN)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        assert gone(child, 5)
    finally:
        parent.kill()
        parent.wait()


def test_a_child_whose_parent_died_before_it_asked_exits_at_once():
    proc = python("from trainscale.runtime.orphans import die_with_parent\ndie_with_parent(parent=1)\nprint('alive')")
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (1, "")


def test_a_worker_stops_silently_on_sigint():
    proc = python(
        "from trainscale.runtime.orphans import die_quietly_on_stop\nimport time\ndie_quietly_on_stop()\n"
        "print('ready', flush=True)\ntime.sleep(60)"
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert (proc.returncode, err) == (-signal.SIGINT, "")


# ------------------------------------------------------------------ the run folder's lock (results.lock_run_folder)


def test_the_run_folder_lock_refuses_a_second_holder_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    with lock_run_folder(out):
        assert lock_holder(out) == os.getpid()
        with pytest.raises(ConfigError, match=rf"is in use by another trainscale job \(pid {os.getpid()}\); wait"):
            with lock_run_folder(out):
                pass
        check_run_folder(out, resume=False)  # this process's own lock is no obstacle, its file no run file
    assert lock_holder(out) is None
    assert not out.exists()  # the lock made the folder and the job wrote nothing


def test_a_job_that_wrote_nothing_leaves_none_of_the_folders_its_lock_made(tmp_path):
    """Also the parents (before, a run refused after its lock, such as a model that cannot take the images, left an
    empty `runs/` behind); a parent holding another job's folder stays."""
    with lock_run_folder(tmp_path / "runs" / "a" / "run"):
        (tmp_path / "runs" / "b").mkdir()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["b"]
    (tmp_path / "runs" / "b").rmdir()
    (tmp_path / "runs").rmdir()
    with lock_run_folder(tmp_path / "runs" / "a" / "run"):
        assert (tmp_path / "runs" / "a" / "run" / LOCK_FILE).exists()
    assert not list(tmp_path.iterdir())


def test_a_lock_file_left_by_a_killed_job_is_no_obstacle(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("99999\n")
    assert lock_holder(out) is None
    check_run_folder(out, resume=False)
    with pytest.raises(ConfigError, match="--resume: no checkpoint"):
        check_run_folder(out, resume=True)
    with lock_run_folder(out):
        (out / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


HOLDER = (
    "import sys\nfrom trainscale.results import lock_run_folder\nwith lock_run_folder(sys.argv[1]):\n"
    "    print('held', flush=True)\n    sys.stdin.read()\n"
)


def test_a_folder_another_process_holds_is_refused_by_the_checks(tmp_path):
    out = tmp_path / "run"
    holder = python(HOLDER, str(out))
    try:
        assert holder.stdout.readline() == "held\n"
        message = rf"--out {out} is in use by another trainscale job \(pid {holder.pid}\)"
        with pytest.raises(ConfigError, match=message):
            check_run_folder(out, resume=True)  # said before anything about the folder's contents
        with pytest.raises(ConfigError, match=message):
            with lock_run_folder(out):
                pass
    finally:
        holder.communicate("", timeout=10)
    assert lock_holder(out) is None


def test_a_stop_handler_outside_the_main_thread_changes_nothing_and_raises_nothing():
    """`trainscale.fit(..., fault_tolerance=True)` from a thread of the user's raised "signal only works in main
    thread" from the launcher's SIGTERM handler; there the block now runs with the process's handlers as they are."""
    import threading

    from trainscale.runtime.orphans import sigterm_as_interrupt

    before, seen = signal.getsignal(signal.SIGTERM), []

    def enter() -> None:
        with sigterm_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before] and signal.getsignal(signal.SIGTERM) is before
