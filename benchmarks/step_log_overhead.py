"""What live metrics cost: trainscale's epoch loop with ``--log-every N`` against the same loop without them.

Both sides run ``train_one_epoch`` over the same ``DeviceBatches`` of synthetic images with the same model copy,
batch and precision; the measured side also keeps a ``StepLog`` that reads the device every N steps and hands each
row to a sink (a list here: the file append is the writer's, outside the device timeline). Timer scope: whole
passes, device-synchronised, warm-up passes excluded, the sides interleaved repeat by repeat. The figure to watch
is the paired ratio ``with / without`` (1.00: free); on a GPU each row is one device sync.

    python benchmarks/step_log_overhead.py --model resnet20 --images 4096 --batch 256 --every 50 10 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainscale.bench.script import COUNT, WARMUP, device_name, model_name, run_script
from trainscale.bench.timing import paired_ratios, save_result, time_interleaved
from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.errors import OneLineParser
from trainscale.models import create_model
from trainscale.train.environment import environment
from trainscale.train.loop import train_one_epoch
from trainscale.train.precision import Precision, resolve_device
from trainscale.train.steplog import StepLog


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=model_name, default="resnet20")
    p.add_argument("--images", type=COUNT, default=4096, help="images per pass")
    p.add_argument("--batch", type=COUNT, default=256)
    p.add_argument("--every", type=COUNT, nargs="+", default=[50, 10], help="--log-every values to measure")
    p.add_argument("--repeats", type=COUNT, default=5)
    p.add_argument("--warmup", type=WARMUP, default=1)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--device", type=device_name, default="auto")
    p.add_argument("--out", default=f"runs/bench/step_log_overhead-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return p.parse_args(argv)


def loop(model: torch.nn.Module, batches: DeviceBatches, precision: Precision, every: int) -> Callable[[], None]:
    """One pass per call of trainscale's loop; ``every`` > 0 keeps a StepLog with rows every ``every`` steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = precision.grad_scaler()
    rows: list[dict[str, Any]] = []
    log = StepLog(every, 1, rows.append) if every else None
    counter = iter(range(10**9))

    def run() -> None:
        train_one_epoch(
            model, batches, opt, scaler, precision, lambda t: 0.01, next(counter), progress=False, step_log=log
        )

    return run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    data = synthetic_dataset(args.images, 32, seed=0)
    batches = DeviceBatches(
        data,
        args.batch,
        train=True,
        augment=AugmentConfig(crop_padding=4, flip=True),
        device=device,
        channels_last=True,
    )
    torch.manual_seed(0)
    model = create_model(args.model).to(device).to(memory_format=torch.channels_last)
    precision = Precision(args.precision, device)
    fns = {f"every {n}" if n else "off": loop(copy.deepcopy(model), batches, precision, n) for n in [0, *args.every]}
    timings = time_interleaved(fns, args.repeats, args.warmup, device)
    images = batches.num_samples
    env = environment(device)
    print(f"{args.model}, batch {args.batch}, {args.precision}, {images} images/pass, {env.get('device_name')}")
    result: dict[str, Any] = {"config": vars(args), "environment": env, "timings": timings, "ratios": {}}
    for name, timing in timings.items():
        rate, spread = timing.rate(images)
        line = f"  {name:>9}: {rate:8.0f} img/s (+- {spread:.0f})"
        if name != "off":
            ratio = statistics.median(paired_ratios(timings["off"], timing))
            result["ratios"][name] = ratio
            line += f", throughput {ratio:.3f} of off (paired median)"
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_result(Path(args.out), result)


if __name__ == "__main__":
    run_script(main)
