"""Workers forked from the `trainscale train` launcher (``app.launch.start_method``): when a fork is chosen, what a
forked worker undoes of its launcher, and how a job's failure is still traced to its root cause when torch's agent
reports only the first failed process it finds (``app.exits``). The forked jobs themselves run in tests/integration
and tests/dist.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainscale.app.config import TrainConfig
from trainscale.app.exits import PID_FILE, ChildExits, note_worker
from trainscale.app.failures import describe_failure, every_failure
from trainscale.app.launch import as_new_process, start_method
from trainscale.models.registry import MODELS
from trainscale.runtime.orphans import FAILED_NOTICES, AgentStopNotices
from trainscale.runtime.worker_errors import recorded


def worker() -> None:
    """A stand-in for the entry point's forked-worker function."""


def test_fork_only_for_the_command_lines_launcher_and_where_no_cuda_runtime_can_be_inherited(monkeypatch):
    cpu = TrainConfig().replace(device="cpu")
    assert start_method(cpu, worker) == "fork"
    assert start_method(cpu.replace(start_method="spawn"), worker) == "spawn"
    assert start_method(cpu, None) == "spawn"  # trainscale.fit in the caller's process
    assert start_method(cpu.replace(devices=[0]), worker) == "spawn"
    auto = TrainConfig().replace(device="auto")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert start_method(auto, worker) == "fork"  # a CPU build of torch has no CUDA to inherit
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert start_method(auto, worker) == "spawn"  # the pre-flight may have asked CUDA about its devices
    assert start_method(cpu, worker) == "fork"


def write_error(folder: Path, local_rank: int, exc: BaseException) -> Path:
    """The error file a worker of that local rank writes through ``recorded`` (the agent's layout:
    attempt_N/<local rank>/error.json)."""
    path = folder / str(local_rank) / "error.json"
    path.parent.mkdir(parents=True)

    def fail() -> None:
        raise exc

    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        with pytest.raises(type(exc)):
            recorded(fail)()
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    return path


def test_a_forked_jobs_root_cause_is_found_among_the_ranks_the_agent_did_not_report(tmp_path):
    """torch's agent reported one rank that lost its peer; the others left error files or exit statuses."""
    import torch.distributed as dist

    from trainscale.errors import ConfigError

    attempt = tmp_path / "run_x" / "attempt_0"
    root = write_error(attempt, 1, ConfigError("no such file: labels.csv"))
    time.sleep(0.01)
    peer = write_error(attempt, 0, dist.DistBackendError("[gloo] Connection closed by peer"))
    (attempt / "2").mkdir()  # a rank the agent stopped (SIGTERM): not a failure
    (attempt / "3").mkdir()  # a rank whose end was not seen
    statuses = {"0": 1, "1": 2, "2": -signal.SIGTERM}
    reported = {4: ProcessFailure(0, 99, 1, str(peer))}  # node 2 of a job of 4 workers per node: ranks 4 to 7

    failures = every_failure(reported, lambda folder: statuses.get(folder.name))
    assert sorted(failures) == [4, 5] and failures[5].local_rank == 1 and failures[5].error_file == str(root)
    line, status = describe_failure(failures)
    assert line.startswith("worker rank 5 (local rank 1) failed: ConfigError: no such file: labels.csv"), line
    assert line.endswith("the other workers were stopped (rank 4)") and status == 2
    assert describe_failure(reported)[0].startswith("worker rank 4")  # what the agent alone says
    assert every_failure({0: ProcessFailure(0, 9, -9, os.devnull)}, statuses.get).keys() == {0}  # no folders kept


def test_a_forked_rank_killed_without_a_word_is_named_from_its_exit_status(tmp_path):
    """The parameter server rank 3 was killed (SIGKILL: no error file); the agent reported worker rank 0, which
    lost it a moment later."""
    from trainscale.modes.ps.client import ServerLost

    attempt = tmp_path / "run_x" / "attempt_0"
    peer = write_error(attempt, 0, ServerLost("parameter server rank 3 is gone"))
    for local in (1, 2, 3):
        (attempt / str(local)).mkdir()
    statuses = {"1": -signal.SIGTERM, "2": -signal.SIGTERM, "3": -signal.SIGKILL}
    failures = every_failure({0: ProcessFailure(0, 99, 1, str(peer))}, lambda folder: statuses.get(folder.name))
    assert sorted(failures) == [0, 3] and failures[3].exitcode == -signal.SIGKILL
    line, status = describe_failure(failures, first_server=3)
    assert line.startswith("parameter server rank 3 (local rank 3) failed: Signal 9 (SIGKILL)"), line
    assert status == 1


def fork_worker(folder: Path, code: int, linger_s: float) -> int:
    """A child of this process that notes itself as a forked worker in ``folder``, then ends with ``code`` after
    ``linger_s`` unless a signal ends it first; returns once it has noted itself."""
    folder.mkdir(parents=True)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            note_worker(str(folder / "error.json"))
            os.write(write, b"1")
            time.sleep(linger_s)
        finally:
            os._exit(code)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    return pid


def test_the_launcher_learns_each_forked_workers_exit_status_though_another_reaps_it(tmp_path):
    """Four children noted as workers: one exits 3, one is killed, one terminated, one ends well; the watcher
    reads each status as it dies and leaves the child for its parent to reap (torch's agent, every 0.1 s)."""
    codes = {0: (3, 0.0), 1: (0, 60.0), 2: (0, 60.0), 3: (0, 0.05)}
    with ChildExits() as exits:
        pids = {rank: fork_worker(tmp_path / str(rank), code, linger) for rank, (code, linger) in codes.items()}
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[2], signal.SIGTERM)
        time.sleep(0.3)
        reaped = {rank: os.waitpid(pid, 0)[1] for rank, pid in pids.items()}  # still there to reap
        seen = {rank: exits.of_worker(tmp_path / str(rank)) for rank in codes}
    assert reaped == {0: 3 << 8, 1: signal.SIGKILL, 2: signal.SIGTERM, 3: 0}
    assert seen == {0: 3, 1: -signal.SIGKILL, 2: -signal.SIGTERM, 3: 0}
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / PID_FILE).write_text(f"{pids[1]} 1\n")  # that process id, started at another time
    assert exits.of_worker(tmp_path / "4") is None and exits.of_worker(tmp_path / "5") is None


def test_the_agents_notice_of_a_failed_forked_worker_is_dropped_or_kept_without_its_traceback():
    try:
        raise RuntimeError("process 1 terminated with exit code 1")
    except RuntimeError:
        exc_info = sys.exc_info()
    args = (1, 1, 42, "forked_worker", "fork")
    record = logging.LogRecord("torch.distributed.elastic", logging.ERROR, "x", 1, FAILED_NOTICES[1], args, exc_info)
    assert not AgentStopNotices(restarts=False).filter(record)
    assert AgentStopNotices(restarts=True).filter(record)
    assert record.exc_info is None and record.getMessage().startswith("failed (exitcode: 1) local_rank: 1")
    closing = logging.LogRecord("t", logging.WARNING, "x", 1, "Closing process %s via signal %s", (7, "SIGTERM"), None)
    assert not AgentStopNotices(restarts=True).filter(closing)


USER_MODULE = """
import os
RANK_AT_IMPORT = os.environ.get("RANK", "launcher")

def tiny(num_classes=10, **_):
    import torch
    net = torch.nn.Linear(2, num_classes)
    net.rank_at_import = RANK_AT_IMPORT
    return net
"""


def test_a_forked_worker_imports_the_users_modules_again_and_starts_with_default_signal_handlers(tmp_path):
    """In a real fork of this process: a user's model module imported here (the launcher) is imported again in
    the child, so what it read from the environment at import is the worker's; the registry's entry for its import
    path follows the new module; signal handlers and the temporary folder are a new process's."""
    (tmp_path / "usernets_forked.py").write_text(textwrap.dedent(USER_MODULE))
    sys.path.insert(0, str(tmp_path))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP)}
    try:
        path = "usernets_forked:tiny"
        assert MODELS.create(path).rank_at_import == "launcher"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        tempfile.gettempdir()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave at once
            os.close(read)
            code = 1
            try:
                os.environ.update(RANK="3", TMPDIR=str(tmp_path))
                as_new_process()
                facts = (
                    MODELS.create(path).rank_at_import,
                    signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
                    signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                    tempfile.gettempdir() == str(tmp_path),
                    "usernets_forked" in sys.modules,
                )
                os.write(write, repr(facts).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            facts = pipe.read()
        assert os.waitpid(pid, 0)[1] == 0
        assert facts == repr(("3", True, True, True, True))
        assert MODELS.create(path).rank_at_import == "launcher"  # this process keeps its own
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("usernets_forked", None)
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.dist
def test_forked_workers_train_as_new_interpreters_do(tmp_path):
    """`trainscale train --workers 2` forks its workers and says so; with --start-method spawn each is a new
    interpreter, as torchrun starts them; the two runs train alike."""
    flags = ["--model", "mlp", "--dataset", "synthetic", "--train-subset", "64", "--test-subset", "32"]
    flags += ["--batch-size", "16", "--epochs", "1", "--workers", "2", "--no-progress", "--seed", "3"]
    rows = []
    for method, said in (("auto", "forked from this process"), ("spawn", "each a new interpreter")):
        out = tmp_path / method
        argv = [sys.executable, "-m", "trainscale", "train", *flags, "--start-method", method, "--out", str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        rows.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[0]))
    forked, spawned = rows
    for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
        assert forked[key] == pytest.approx(spawned[key], abs=1e-6), (key, forked, spawned)


def test_a_forked_worker_takes_torchs_cpp_log_level_back_from_a_quieted_launcher(monkeypatch):
    """A launcher of a node that does not host the rendezvous quiets torch's C++ warnings while its agent runs
    (``store_warnings_quiet``); a worker it forks starts as a new interpreter would: TORCH_CPP_LOG_LEVEL's level,
    else torch's own (WARNING), not the launcher's ERROR."""
    from trainscale.app.launch import CPP_LOG_LEVELS, cpp_log_level, cpp_log_level_from_env, store_warnings_quiet

    before = cpp_log_level()
    assert before is not None
    try:
        with store_warnings_quiet(True):
            assert cpp_log_level() == CPP_LOG_LEVELS["ERROR"]
            monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
            cpp_log_level_from_env()  # what a forked worker does first (``as_new_process``)
            assert cpp_log_level() == CPP_LOG_LEVELS["WARNING"]
            monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
            cpp_log_level_from_env()
            assert cpp_log_level() == CPP_LOG_LEVELS["ERROR"]
        assert cpp_log_level() == before  # the launcher's own level back after its agent
        with store_warnings_quiet(False):
            assert cpp_log_level() == before
    finally:
        cpp_log_level(before)
