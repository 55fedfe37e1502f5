"""Step time of trainscale's sync mode against a bare DDP loop: same model, batch, precision, processes.

One `torch.distributed.run` job of ``--workers`` processes runs both sides, interleaved repeat by
repeat so drift and background load hit both alike, each from the same initial weights:

- trainscale: ``SyncMode`` as `trainscale train --mode sync` uses it (DDP + the byte-counting
  all-reduce hook) driving trainscale's real epoch loop (``train_one_epoch`` over ``DeviceBatches``:
  per-step LR, autocast, grad scaler, on-device metrics, all-reduced loss/accuracy at the end).
- bare: ``DistributedDataParallel`` with its built-in C++ all-reduce, a hand-written loop over
  pre-normalised batches (forward, loss, backward, step).

Both sides: synthetic images, the same per-worker batch, precision and memory format; buffers are not
broadcast before each forward on either side (trainscale averages BN statistics at epoch end instead,
outside the timed steps). Augmentation is off by default so both do the same work (``--augment``
turns on trainscale's crop+flip). Timer scope: whole passes of ``--steps`` steps, device-synchronised
on rank 0, ``--warmup`` passes per side excluded; step time = pass time / steps.

    python benchmarks/sync_overhead.py --model resnet20 --batch 64 --steps 10 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from trainscale.bench.script import COUNT, WARMUP, device_name, model_name, run_child, run_script
from trainscale.errors import OneLineParser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=model_name, default="resnet20")
    p.add_argument("--batch", type=COUNT, default=64, help="per-worker batch")
    p.add_argument("--steps", type=COUNT, default=10, help="steps per timed pass")
    p.add_argument("--repeats", type=COUNT, default=5)
    p.add_argument("--warmup", type=WARMUP, default=1)
    p.add_argument("--workers", type=COUNT, default=2)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--augment", action="store_true", help="trainscale side does its crop+flip augmentation")
    p.add_argument(
        "--no-hook",
        action="store_true",
        help="diagnostic: trainscale side with DDP's built-in all-reduce instead of its counting hook",
    )
    p.add_argument("--device", type=device_name, default="auto")
    p.add_argument("--out", default=f"runs/bench/sync_overhead-{time.strftime('%Y%m%d-%H%M%S')}.json")
    p.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)  # set for the workers
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- in each worker


def make_model(name: str, device: torch.device) -> torch.nn.Module:
    from trainscale.models import create_model

    torch.manual_seed(0)
    return create_model(name).to(device).to(memory_format=torch.channels_last)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)


def trainscale_side(mode, model, data, args, device, precision) -> Callable[[], None]:
    from trainscale.data import AugmentConfig, DeviceBatches
    from trainscale.runtime.dist import rank, world_size
    from trainscale.train.loop import train_one_epoch

    augment = AugmentConfig(crop_padding=4, flip=True) if args.augment else AugmentConfig(crop_padding=0, flip=False)
    batches = DeviceBatches(
        data,
        args.batch,
        train=True,
        augment=augment,
        device=device,
        rank=rank(),
        world_size=world_size(),
        channels_last=True,
    )
    ddp = mode.wrap_model(model, device)
    opt, scaler, epochs = sgd(model), precision.grad_scaler(), iter(range(10**9))

    def run() -> None:
        train_one_epoch(ddp, batches, opt, scaler, precision, lambda t: 0.01, next(epochs), progress=False)

    return run


def bare_side(model, data, args, device, precision) -> Callable[[], None]:
    from torch.nn.parallel import DistributedDataParallel

    from trainscale.data import DeviceBatches
    from trainscale.modes.sync import no_forward_buffer_sync
    from trainscale.runtime.dist import rank, world_size

    x, y = next(
        iter(
            DeviceBatches(
                data,
                len(data),
                train=False,
                augment=None,
                device=device,
                rank=rank(),
                world_size=world_size(),
                channels_last=True,
            ).epoch(0)
        )
    )
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, **no_forward_buffer_sync()
    )
    opt = sgd(model)

    def run() -> None:
        ddp.train()
        for i in range(0, args.steps * args.batch, args.batch):
            with precision.autocast():
                loss = F.cross_entropy(ddp(x[i : i + args.batch]).float(), y[i : i + args.batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run


def with_cpu_time(fn: Callable[[], None], log: list[float]) -> Callable[[], None]:
    """``fn`` that also records this process's CPU seconds per call: on a loaded machine wall time mostly
    measures the neighbours, CPU time still measures the work each side does."""

    def run() -> None:
        start = time.process_time()
        fn()
        log.append(time.process_time() - start)

    return run


def worker(args: argparse.Namespace) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from trainscale.modes.sync import SyncMode, no_forward_buffer_sync
    from trainscale.runtime.dist import is_main_process
    from trainscale.train.precision import resolve_device

    mode = SyncMode()
    if args.no_hook:
        mode.wrap_model = lambda model, device: DistributedDataParallel(model, **no_forward_buffer_sync())
    device = mode.worker_device(resolve_device(args.device))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with mode.session(device):
        result = measure(mode, args, device)
        if is_main_process():
            Path(args.worker_result).write_text(json.dumps(result))


def measure(mode, args: argparse.Namespace, device: torch.device) -> dict:
    """Both sides' timings. Their DDP wrappers live in this call only, so they are freed inside the mode's session,
    before it destroys the process group they hold (freed after it, gloo's teardown could wait forever)."""
    from trainscale.bench.timing import time_interleaved
    from trainscale.data import synthetic_dataset
    from trainscale.runtime.dist import world_size
    from trainscale.train.environment import environment
    from trainscale.train.precision import Precision

    data = synthetic_dataset(args.steps * args.batch * world_size(), 32, seed=0)
    precision = Precision(args.precision, device)
    model = make_model(args.model, device)
    cpu: dict[str, list[float]] = {"bare": [], "trainscale": []}
    fns = {
        "bare": with_cpu_time(bare_side(copy.deepcopy(model), data, args, device, precision), cpu["bare"]),
        "trainscale": with_cpu_time(trainscale_side(mode, model, data, args, device, precision), cpu["trainscale"]),
    }
    timings = time_interleaved(fns, args.repeats, args.warmup, device)
    return {
        "timings": {k: t.seconds for k, t in timings.items()},
        "cpu": {k: v[args.warmup :] for k, v in cpu.items()},  # warm-up calls come first
        "comm": mode.stats.per_step(),
        "world_size": world_size(),
        "backend": mode.backend,
        "environment": environment(device),
    }


# ---------------------------------------------------------------------------------- the parent


def launch(args: argparse.Namespace, result_path: Path) -> None:
    """Both sides in one torch.distributed.run job (standalone c10d rendezvous on this machine)."""
    threads = max(1, len(os.sched_getaffinity(0)) // args.workers)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.workers}",
        f"--log-dir={result_path.parent / 'agent'}",  # torch's agent folder beside the result, not left in /tmp
        __file__,
        *sys.argv[1:],
        "--worker-result",
        str(result_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run_child(argv, check=True, env=env)


def summarise(args: argparse.Namespace, raw: dict) -> dict:
    from trainscale.bench.timing import Timing, paired_ratios

    steps = {k: Timing([s / args.steps for s in v]) for k, v in raw["timings"].items()}
    images = args.batch * raw["world_size"]
    paired = paired_ratios(steps["trainscale"], steps["bare"])
    return {
        "config": {k: v for k, v in vars(args).items() if k != "worker_result"},
        "step_seconds": steps,
        "images_per_s": {k: t.rate(images) for k, t in steps.items()},
        "ratio_trainscale_over_bare": steps["trainscale"].mean / steps["bare"].mean,
        "paired_ratios": paired,
        "paired_ratio_median": statistics.median(paired),
        "cpu_step_seconds": {k: Timing([s / args.steps for s in v]) for k, v in raw["cpu"].items()},
        "comm_per_step": raw["comm"],
        "world_size": raw["world_size"],
        "backend": raw["backend"],
        "environment": raw["environment"],
    }


def print_result(result: dict, args: argparse.Namespace) -> None:
    print(
        f"{args.workers} workers over {result['backend']}, {args.model}, batch {args.batch}/worker, "
        f"{args.precision} + channels_last, augmentation {'on (trainscale side)' if args.augment else 'off'}"
        + (", trainscale side WITHOUT its counting hook (diagnostic)" if args.no_hook else "")
    )
    for side in ("bare", "trainscale"):
        t, (rate, spread) = result["step_seconds"][side], result["images_per_s"][side]
        print(f"{side:>10}: {1000 * t.mean:8.1f} ± {1000 * t.stdev:5.1f} ms/step   {rate:7.1f} ± {spread:5.1f} img/s")
    paired = result["paired_ratios"]
    print(
        f"step-time ratio trainscale / bare DDP: {result['ratio_trainscale_over_bare']:.3f} of the means; "
        f"per interleaved pair median {result['paired_ratio_median']:.3f} "
        f"(range {min(paired):.3f}-{max(paired):.3f}); target <= 1.03"
    )
    cpu = {k: (1000 * t.mean, 1000 * t.stdev) for k, t in result["cpu_step_seconds"].items()}
    print(
        f"CPU time per step (rank 0 process): bare {cpu['bare'][0]:.1f} ± {cpu['bare'][1]:.1f} ms, "
        f"trainscale {cpu['trainscale'][0]:.1f} ± {cpu['trainscale'][1]:.1f} ms, "
        f"ratio {cpu['trainscale'][0] / cpu['bare'][0]:.3f}"
    )
    sent = result["comm_per_step"]["bytes_sent_per_step"]
    if sent is not None:
        print(f"trainscale hook: {sent / 2**20:.2f} MiB per worker per step")
    print(
        f"timer: {args.repeats} interleaved passes of {args.steps} steps per side, {args.warmup} warm-up pass(es) "
        "excluded, rank 0, device-synchronised"
    )


def main() -> None:
    args = parse_args()
    if args.worker_result:
        worker(args)
        return
    from trainscale.bench.timing import save_result

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        launch(args, path)
        result = summarise(args, json.loads(path.read_text()))
    print_result(result, args)
    save_result(Path(args.out), result)
    print(f"saved {args.out}")


if __name__ == "__main__":
    run_script(main)
