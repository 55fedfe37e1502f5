"""Training images/s of trainscale's loop against a bare hand-written PyTorch loop, in one run.

Both sides train the same model from the same weights on the same images with the same batch,
precision and memory format; trainscale's side adds what it really does each step (on-device
augmentation, per-step LR, on-device metrics) and takes the training step ``trainscale train`` takes
there (``--train-step auto``: eager on a CPU, compiled and captured in CUDA graphs on one GPU; its
compilation falls in the warm-up). Timer scope: whole passes over the same images, device-synchronised,
warm-up passes excluded, repeats interleaved. Also prints bf16+channels_last against fp32 for
trainscale's loop.

    python benchmarks/throughput.py --models resnet9 resnet32 --images 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainscale.bench.script import COUNT, WARMUP, device_name, model_name, run_script
from trainscale.bench.timing import paired_ratios, save_result, time_interleaved
from trainscale.data import AugmentConfig, DeviceBatches, synthetic_dataset
from trainscale.errors import OneLineParser
from trainscale.models import create_model
from trainscale.train.environment import environment
from trainscale.train.loop import train_one_epoch
from trainscale.train.precision import Precision, resolve_device
from trainscale.train.step import STEP_KINDS, StepChoice, choose_step, make_step


def make_model(name: str, device: torch.device, channels_last: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(name).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def bare_loop(model, images: torch.Tensor, labels: torch.Tensor, batch: int, precision: Precision):
    """The hand-written baseline: slice pre-normalised batches, forward, backward, step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def run() -> None:
        model.train()
        for i in range(0, len(images) - batch + 1, batch):
            with precision.autocast():
                loss = F.cross_entropy(model(images[i : i + batch]).float(), labels[i : i + batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run


def step_choice(setting: str, precision: Precision) -> StepChoice:
    """The training step a one-process ``trainscale train`` of a built-in model takes with ``--train-step``."""
    return choose_step(setting, precision.device, precision.name, "none", "stop")


def trainscale_loop(model, batches: DeviceBatches, precision: Precision, step: str):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = precision.grad_scaler()
    counter = iter(range(10**9))
    kind = step_choice(step, precision).kind
    step_fn = None if kind == "eager" else make_step(kind, model, opt, precision, 0.0)

    def run() -> None:
        train_one_epoch(
            model, batches, opt, scaler, precision, lambda t: 0.01, next(counter), progress=False, step_fn=step_fn
        )

    return run


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    data = synthetic_dataset(args.images, 32, seed=0)
    batches = DeviceBatches(
        data,
        args.batch,
        train=True,
        augment=AugmentConfig(crop_padding=4, flip=True),
        device=device,
        channels_last=True,
    )
    x, y = next(
        iter(DeviceBatches(data, args.images, train=False, augment=None, device=device, channels_last=True).epoch(0))
    )
    bf16 = Precision(args.precision, device)
    fp32 = Precision("fp32", device)
    model = make_model(name, device, channels_last=True)
    fns = {
        "bare": bare_loop(copy.deepcopy(model), x, y, args.batch, bf16),
        "trainscale": trainscale_loop(copy.deepcopy(model), batches, bf16, args.train_step),
        "trainscale_fp32": trainscale_loop(
            make_model(name, device, channels_last=False),
            DeviceBatches(
                data,
                args.batch,
                train=True,
                augment=AugmentConfig(crop_padding=4, flip=True),
                device=device,
                channels_last=False,
            ),
            fp32,
            args.train_step,
        ),
    }
    timings = time_interleaved(fns, args.repeats, args.warmup, device)
    images = batches.num_samples
    paired = paired_ratios(timings["bare"], timings["trainscale"])
    return {
        "model": name,
        "train_step": {p.name: step_choice(args.train_step, p).kind for p in (bf16, fp32)},
        "timings": timings,
        "images_per_pass": images,
        "img_per_s": {k: t.rate(images) for k, t in timings.items()},
        "ratio_trainscale_vs_bare": timings["bare"].mean / timings["trainscale"].mean,
        "paired_ratios": paired,
        "paired_ratio_median": statistics.median(paired),
        "speedup_bf16_cl_vs_fp32": timings["trainscale_fp32"].mean / timings["trainscale"].mean,
    }


def main() -> None:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=model_name, nargs="+", default=["resnet9", "resnet32"])
    p.add_argument("--images", type=COUNT, default=2048, help="images per timed pass")
    p.add_argument("--batch", type=COUNT, default=256)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--repeats", type=COUNT, default=3)
    p.add_argument("--warmup", type=WARMUP, default=1)
    p.add_argument("--device", type=device_name, default="auto")
    p.add_argument(
        "--train-step", default="auto", choices=STEP_KINDS, help="trainscale's step, as trainscale train's flag"
    )
    p.add_argument("--out", default=f"runs/bench/throughput-{time.strftime('%Y%m%d-%H%M%S')}.json")
    args = p.parse_args()
    device = resolve_device(args.device)
    results = []
    print(
        f"{'model':>10} {'bare img/s':>16} {'trainscale img/s':>18} {'ratio':>6} {'pairs':>6} {'fp32 img/s':>16} "
        f"{'bf16+CL/fp32':>12}"
    )
    for name in args.models:
        r = bench_model(name, args, device)
        results.append(r)
        (b, bs), (t, ts), (f, fs) = (r["img_per_s"][k] for k in ("bare", "trainscale", "trainscale_fp32"))
        print(
            f"{name:>10} {b:>9.1f} ± {bs:<5.1f} {t:>11.1f} ± {ts:<5.1f} {r['ratio_trainscale_vs_bare']:>6.3f} "
            f"{r['paired_ratio_median']:>6.3f} {f:>9.1f} ± {fs:<5.1f} {r['speedup_bf16_cl_vs_fp32']:>11.2f}x"
        )
    print(
        f"timer scope: {args.repeats} interleaved passes of {args.images} images each side, {args.warmup} "
        f"warm-up pass(es) excluded, device-synchronised; {args.precision} + channels_last unless marked fp32; "
        f"trainscale's step: {results[-1]['train_step'][args.precision]} ({args.train_step}); "
        "ratio = bare mean time / trainscale mean time (target >= 0.97), pairs = median of the per-repeat ratios"
    )
    save_result(Path(args.out), {"config": vars(args), "environment": environment(device), "results": results})
    print(f"saved {args.out}")


if __name__ == "__main__":
    run_script(main)
