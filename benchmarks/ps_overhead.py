"""A worker's training step through the parameter server against the same step trained locally.

Same model (ResNet-32 by default), same batch, same precision and threads, in one run: repeats of
``--steps`` steps alternate between the local loop (forward, backward, torch SGD step) and the PS loop
(forward, backward, push the gradient to the server, pull the parameters: what ``--mode async``
does), so drift hits both alike. The PS side runs one server process (``--servers``) and this
process as worker 0; ``--workers 2`` adds a second worker process that trains continuously through
the same server while worker 0 is timed. The PS step is split into compute (forward + backward +
flatten/assign), push, pull and wait (time the server held the pull for the staleness bound or a
round; 0 in plain ASGD), from the client's own timers. Timer scope: whole steps, warm-up excluded;
data is one synthetic batch already in memory (no loading, no augmentation).

    python benchmarks/ps_overhead.py --model resnet32 --batch 128 --steps 10 --repeats 5

``--cli`` times the path users run instead: ``trainscale train`` as the Multiverso grid's quick scale runs
its 1P1G0M (one process) and 1P1G1M (the same process training through one server) rows, alternating,
each a fresh command with the grid's settings (ResNet-20, 2,000 training images, 2 epochs, bf16, batch
128); the figure is seconds per epoch after the first (the epoch that carries warm-up), the seed's
target the Multiverso page's own +11%. Timer scope: the run's training steps (evaluation and start-up
excluded), as every run's summary reports it.

    python benchmarks/ps_overhead.py --cli --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from trainscale.bench.script import COUNT, WARMUP, model_name, run_child, run_script
from trainscale.bench.timing import Timing, mean_and_spread, save_result, time_interleaved
from trainscale.errors import OneLineParser
from trainscale.models import count_parameters, create_model
from trainscale.record import K
from trainscale.runtime.network import free_port
from trainscale.train.environment import environment
from trainscale.train.precision import Precision

HYPER = dict(lr=0.05, momentum=0.9, weight_decay=1e-4)


def _env(port: int, rank: int, world: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model(args.model).to(memory_format=torch.channels_last)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, 32, 32, generator=gen).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (args.batch,), generator=gen)


def _stepper(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch, precision: Precision, steps: int
) -> Callable[[], None]:
    x, y = batch

    def run() -> None:
        model.train()
        for _ in range(steps):
            with precision.autocast():
                loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run


def _server(port: int, index: int, workers: int, servers: int, threads: int) -> None:
    from trainscale.app.config import build_config
    from trainscale.modes.ps import Role, serve

    world = workers + servers
    _env(port, workers + index, world, threads)
    cfg = build_config(
        {"mode": "async", "workers": workers, "servers": servers, "threads": threads, "rpc_timeout": 120.0}
    )
    serve(cfg, Role("server", index, workers, servers, workers + index, world))


def _ps_optimizer(args: argparse.Namespace, worker: int, model: torch.nn.Module):
    from trainscale.modes.ps import EpochClock, PSOptimizer, ShardClient, rule_from

    local = torch.optim.SGD(model.parameters(), **HYPER)
    client = ShardClient(worker, args.servers, count_parameters(model), timeout_s=120.0)
    opt = PSOptimizer(local, client, rule_from(local, "async", None), 1, EpochClock())
    opt.start()
    return opt, client


def _extra_worker(args: argparse.Namespace, port: int, worker: int, stop, threads: int) -> None:
    """A second worker that trains through the same server until worker 0 is done timing."""
    from trainscale.modes.ps import RpcCollectives, installed_collectives
    from trainscale.runtime import dist as tsdist
    from trainscale.runtime.process_group import rpc_session

    world = args.workers + args.servers
    _env(port, worker, world, threads)
    with rpc_session(f"worker{worker}", worker, world, 120.0):
        with installed_collectives(RpcCollectives(worker, args.workers)):
            model = _model(args)
            opt, client = _ps_optimizer(args, worker, model)
            step = _stepper(model, opt, _batch(args), Precision(args.precision, torch.device("cpu")), 1)
            tsdist.barrier()  # worker 0 starts timing now
            while not stop.is_set():
                step()
            tsdist.barrier()
            client.leave()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from trainscale.modes.ps import RpcCollectives, installed_collectives
    from trainscale.runtime import dist as tsdist
    from trainscale.runtime.process_group import rpc_session

    ctx = mp.get_context("spawn")
    port, stop = free_port(), ctx.Event()
    world = args.workers + args.servers
    procs = [ctx.Process(target=_server, args=(port, s, args.workers, args.servers, 1)) for s in range(args.servers)]
    procs += [
        ctx.Process(target=_extra_worker, args=(args, port, w, stop, args.threads)) for w in range(1, args.workers)
    ]
    for p in procs:
        p.start()
    _env(port, 0, world, args.threads)
    precision = Precision(args.precision, torch.device("cpu"))
    try:
        with rpc_session("worker0", 0, world, 120.0):
            with installed_collectives(RpcCollectives(0, args.workers)):
                local_model, ps_model = _model(args), _model(args)
                ps_opt, client = _ps_optimizer(args, 0, ps_model)
                batch = _batch(args)
                local = _stepper(
                    local_model, torch.optim.SGD(local_model.parameters(), **HYPER), batch, precision, args.steps
                )
                through_ps = _timed_split(_stepper(ps_model, ps_opt, batch, precision, args.steps), client)
                tsdist.barrier()
                timings = time_interleaved(
                    {"local": local, "ps": through_ps}, args.repeats, args.warmup, torch.device("cpu")
                )
                stop.set()
                tsdist.barrier()
                client.leave()
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    splits = through_ps.splits[-args.repeats :]
    return {
        "local": timings["local"],
        "ps": timings["ps"],
        "params": count_parameters(local_model),
        "split_ms_per_step": {k: _mean_sd([s[k] for s in splits], args.steps) for k in splits[0]},
    }


class _timed_split:
    """Runs the PS steps and records, per call, the client's push/pull/wait seconds and the rest."""

    def __init__(self, run: Callable[[], None], client) -> None:
        self.run, self.client, self.splits = run, client, []

    def __call__(self) -> None:
        self.client.stats.reset()
        start = time.perf_counter()
        self.run()
        total = time.perf_counter() - start
        s = self.client.stats
        comm = s.push_seconds + s.pull_seconds + s.wait_seconds
        self.splits.append(
            {"compute": total - comm, "push": s.push_seconds, "pull": s.pull_seconds, "wait": s.wait_seconds}
        )


def _mean_sd(values: list[float], steps: int) -> dict[str, float]:
    mean, stdev = mean_and_spread([1e3 * v / steps for v in values])
    return {"mean": mean, "stdev": stdev}


def _ms(t: Timing, steps: int) -> str:
    median = 1e3 * statistics.median(t.seconds) / steps
    return f"{1e3 * t.mean / steps:8.1f} ± {1e3 * t.stdev / steps:5.1f}  (median {median:6.1f})"


def report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    steps = args.steps
    local, ps = result["local"], result["ps"]
    split = result["split_ms_per_step"]
    print(
        f"{args.model} ({result['params']:,} params), batch {args.batch}, {args.precision}, {args.threads} "
        f"thread(s); {args.repeats} repeats of {steps} steps, interleaved; ms per step (mean ± stdev, median)"
    )
    print(f"  local training                          {_ms(local, steps)}")
    print(f"  through PS ({args.servers} server, {args.workers} worker(s))      {_ms(ps, steps)}")
    print("    split of the PS step: " + ", ".join(f"{k} {v['mean']:.1f} ± {v['stdev']:.1f}" for k, v in split.items()))
    extra = statistics.median(ps.seconds) - statistics.median(local.seconds)
    print(
        f"  overhead per step (medians): {1e3 * extra / steps:+.1f} ms "
        f"({100 * extra / statistics.median(local.seconds):+.1f}%); "
        f"payload {4 * result['params'] / 2**20:.2f} MiB pushed + the same pulled per step"
    )


SEED_OVERHEAD = 0.11  # Multiverso's 1P1G1M against 1P1G0M


def cli_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """The Multiverso grid's quick-scale 1P1G0M and 1P1G1M rows as `trainscale train` flags."""
    common = [
        "--model",
        args.cli_model,
        "--dataset",
        args.dataset,
        "--train-subset",
        "2000",
        "--test-subset",
        "1000",
        "--epochs",
        "2",
        "--schedule",
        "step",
        "--milestones",
        "2",
        "--momentum",
        "0.9",
        "--weight-decay",
        "1e-4",
        "--precision",
        "bf16",
        "--batch-size",
        "128",
        "--lr",
        "0.1",
        "--no-progress",
    ]
    return {
        "1P1G0M": common + ["--mode", "local"],
        "1P1G1M": common + ["--mode", "async", "--workers", "1", "--servers", "1"],
    }


def measure_cli(args: argparse.Namespace) -> dict[str, list[float]]:
    """Steady seconds per epoch of each row, ``--repeats`` fresh runs each, alternating."""
    import json
    import subprocess
    import sys
    import tempfile

    out: dict[str, list[float]] = {name: [] for name in cli_flags(args)}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, flags in cli_flags(args).items():
                folder = Path(tmp) / f"{name}-{repeat}"
                run_child(
                    [sys.executable, "-m", "trainscale", "train", *flags, "--out", str(folder)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                summary = json.loads((folder / "summary.json").read_text())
                out[name].append(summary[K.steady_epoch_seconds] or summary[K.mean_epoch_seconds])
    return out


def report_cli(args: argparse.Namespace, result: dict[str, list[float]]) -> None:
    local, ps = Timing(result["1P1G0M"]), Timing(result["1P1G1M"])
    ratio = statistics.median(p / q for p, q in zip(ps.seconds, local.seconds))
    print(
        f"`trainscale train`, the Multiverso grid's quick scale ({args.cli_model}, {args.dataset}, 2,000 images, "
        f"bf16, batch 128), {args.repeats} alternating runs each; seconds per epoch after the first "
        f"(mean ± stdev):"
    )
    print(f"  1P1G0M (one process)                 {local.mean:7.2f} ± {local.stdev:.2f}")
    print(f"  1P1G1M (through one server)          {ps.mean:7.2f} ± {ps.stdev:.2f}")
    verdict = "PASS" if ratio - 1 <= SEED_OVERHEAD else "FAIL"
    print(
        f"  overhead: {100 * (ratio - 1):+.1f}% (median of paired runs); {verdict} against the seed's "
        f"+{100 * SEED_OVERHEAD:.0f}%"
    )


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", action="store_true", help="time `trainscale train` runs of the grid's rows instead")
    parser.add_argument("--cli-model", type=model_name, default="resnet20")
    parser.add_argument("--dataset", default="cifar10", help="--cli: cifar10 (needs $TRAINSCALE_DATA) or synthetic")
    parser.add_argument("--model", type=model_name, default="resnet32")
    parser.add_argument("--batch", type=COUNT, default=128)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=COUNT, default=10)
    parser.add_argument("--repeats", type=COUNT, default=5)
    parser.add_argument("--warmup", type=WARMUP, default=1)
    parser.add_argument("--servers", type=COUNT, default=1)
    parser.add_argument("--workers", type=COUNT, default=1, help="1, or 2 to time worker 0 beside a second one")
    parser.add_argument("--threads", type=COUNT, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="runs/bench/ps_overhead.json")
    args = parser.parse_args()
    if args.cli:
        result: Any = measure_cli(args)
        report_cli(args, result)
    else:
        result = measure(args)
        report(args, result)
    save_result(
        Path(args.out),
        {
            "config": vars(args),
            "result": result,
            "timer_scope": "whole steps (forward, backward, update or push+pull), warm-up "
            "excluded, one in-memory synthetic batch",
            "environment": environment(torch.device("cpu")),
        },
    )
    print(f"saved {args.out}")


if __name__ == "__main__":
    run_script(main)
