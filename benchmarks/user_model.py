"""A user's own network through trainscale against a bare DDP loop of the same network, on CIFAR-10.

The network is a small ViT written outside the package (``tests/userpkg/nets.py``: ``vit``), given to trainscale by
import path exactly as a user would (``--model tests.userpkg.nets:vit --model-arg dim=... depth=...``), trained
with AdamW on both sides. Cells (``--cells``, default all), each run for two epochs so the figure is the steady second
epoch:

- ``local``, 1 process: ``trainscale train`` (local mode) against a bare single-process loop;
- ``sync``, ``topk``, ``bf16``, 2 workers: ``trainscale train --workers 2`` with no compression, with ``--compress
  topk`` and with ``--compress bf16``, each against a bare ``DistributedDataParallel`` loop of 2 processes started by
  ``torch.distributed.run`` (dense fp32 all-reduce, DDP's own C++ hook).

Images/s: trainscale's steady training throughput (``record.throughput``: the epochs after the first; training
steps only); the bare loop times its second pass over the same number of steps. Both sides: the same CIFAR-10
subset, per-worker batch, fp32, channels-last off, no augmentation (``--crop-padding 0 --no-flip``), threads split
over the workers alike. Bytes per step: what a worker hands to collectives per step (trainscale's
``bytes_sent_per_step``; the bare loop: the fp32 gradient, 4 bytes per parameter). Each of ``--repeats`` rounds runs
the bare loops and then every cell, one after another, so drift hits both sides of a round alike; a cell's ratio is
the median over the rounds of its images/s over the bare loop's of the same process count in the same round.

    TRAINSCALE_DATA=/path/to/cifar-10-batches-bin python benchmarks/user_model.py
    python benchmarks/user_model.py --tiny --repeats 1   # a check that it runs: tiny model, a few steps (no figures)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import torch
import torch.nn.functional as F

from trainscale.app.worker_env import to_argv
from trainscale.bench.script import COUNT, check_run, run_child, run_script
from trainscale.bench.timing import mean_and_spread, save_result
from trainscale.errors import OneLineParser
from trainscale.record import throughput

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tests.userpkg.nets:vit"
CELLS = {  # name: (label, workers, compressor)
    "local": ("1 process", 1, None),
    "sync": ("2 workers", 2, None),
    "topk": ("2 workers topk", 2, "topk"),
    "bf16": ("2 workers bf16", 2, "bf16"),
}
OPTIMIZER = "adamw"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=COUNT, default=128, help="ViT width")
    p.add_argument("--depth", type=COUNT, default=6, help="ViT blocks")
    p.add_argument("--batch", type=COUNT, default=128, help="per-worker batch")
    p.add_argument("--steps", type=COUNT, default=40, help="steps per epoch (the train subset is sized by it)")
    p.add_argument("--ratio", type=float, default=0.01, help="Top-k's kept fraction")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeats", type=COUNT, default=3, help="rounds of every cell and the bare loops (default 3)")
    p.add_argument("--cells", nargs="+", choices=tuple(CELLS), default=list(CELLS), help="which cells (default all)")
    p.add_argument("--tiny", action="store_true", help="dim 16, depth 1, batch 8, 3 steps: checks that it runs")
    p.add_argument("--out", default=f"runs/bench/user_model-{time.strftime('%Y%m%d-%H%M%S')}.json")
    p.add_argument("--bare-worker", default=None, help=argparse.SUPPRESS)  # a bare-loop process: its result file
    args = p.parse_args(argv)
    if args.tiny:
        args.dim, args.depth, args.batch, args.steps = 16, 1, 8, 3
    return args


def model_args(args: argparse.Namespace) -> dict[str, int]:
    return {"dim": args.dim, "depth": args.depth, "heads": 4 if args.dim % 4 == 0 else 1}


# --------------------------------------------------------------------------------------------- trainscale


def cell_settings(args: argparse.Namespace, workers: int, compress: str | None, out: Path) -> dict[str, Any]:
    """One cell's `trainscale train` settings (``trainscale.fit``'s keywords) for the user's model."""
    settings: dict[str, Any] = dict(
        model=MODEL, model_args=[f"{k}={v}" for k, v in model_args(args).items()],
        dataset="cifar10", train_subset=args.batch * workers * args.steps, test_subset=500,
        epochs=2, batch_per_worker=args.batch, optimizer=OPTIMIZER, lr=args.lr,
        schedule="constant", weight_decay=0.05,
        crop_padding=0, flip=False, channels_last=False, progress=False, checkpoint=False, out=str(out),
    )  # fmt: skip
    if workers > 1:
        settings["workers"] = workers
    if compress:
        settings["compress"] = compress
    if compress == "topk":
        settings["ratio"] = args.ratio
    return settings


def trainscale_cell(settings: dict[str, Any]) -> dict:
    """One `trainscale train` run of the user's model; its summary."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = run_child(
        [sys.executable, "-m", "trainscale", "train", *to_argv(settings)],
        cwd=ROOT,
        env=env,
        stdout=PIPE,
        stderr=PIPE,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"trainscale train failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads((Path(settings["out"]) / "summary.json").read_text())


# ------------------------------------------------------------------------------------------- the bare loop


def bare_worker(args: argparse.Namespace) -> None:
    """A bare loop (DDP when launched with several processes): the second of two passes of ``--steps`` steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT))
    from tests.userpkg.nets import vit
    from trainscale.data import load_dataset
    from trainscale.data.augment import normalize

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    data = load_dataset("cifar10", train=True, download=False).subset(args.batch * world * args.steps)
    images = normalize(data.images, data.mean, data.std)[rank::world]
    labels = data.labels[rank::world]
    torch.manual_seed(0)
    model: torch.nn.Module = vit(num_classes=10, image_size=32, **model_args(args))
    if world > 1:
        dist.init_process_group("gloo")
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    seconds = 0.0
    for _ in range(2):
        start = time.perf_counter()
        for step in range(args.steps):
            x = images[step * args.batch : (step + 1) * args.batch]
            y = labels[step * args.batch : (step + 1) * args.batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        seconds = time.perf_counter() - start
    count = sum(p.numel() for p in model.parameters())
    if world > 1:  # DDP holds the group: freed before the group is destroyed (after it, gloo's teardown can hang)
        del model, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        result = {"images_per_sec": args.batch * world * args.steps / seconds, "bytes_per_step": 4.0 * count}
        Path(args.bare_worker).write_text(json.dumps(result))


def bare_cell(args: argparse.Namespace, workers: int, result: Path) -> dict:
    own = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("dim", "depth", "batch", "steps")]
    own += [f"--lr={args.lr}", f"--bare-worker={result}"]
    if workers == 1:
        cmd = [sys.executable, __file__, *own]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
        cmd += [f"--log-dir={result.parent / f'agent{workers}'}", __file__, *own]  # not left in /tmp
    proc = run_child(cmd, stdout=PIPE, stderr=PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bare loop failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")
    return json.loads(result.read_text())


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    if args.bare_worker:
        bare_worker(args)
        return
    from trainscale.train.environment import environment

    chosen = {name: CELLS[name] for name in args.cells}
    with tempfile.TemporaryDirectory(prefix="user-model-bench-") as tmp:
        for name, (label, workers, compress) in chosen.items():
            check_run(cell_settings(args, workers, compress, Path(tmp) / f"{name}-0"), label, ROOT)
        rounds = [one_round(args, chosen, Path(tmp) / f"round-{r}") for r in range(args.repeats)]
    rows = [cell_row(name, chosen[name], [r[name] for r in rounds]) for name in chosen]
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "bare_worker"},
        "model": MODEL,
        "model_args": model_args(args),
        "optimizer": OPTIMIZER,
        "rows": rows,
        "environment": environment(torch.device("cpu")),
    }
    print_rows(args, rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_result(out, result)
    print(f"results in {out}")


def one_round(args: argparse.Namespace, cells: dict[str, tuple[str, int, str | None]], folder: Path) -> dict:
    """One round: the bare loops of the process counts the cells use, then each cell; per cell, both sides'
    images/s and bytes per step."""
    folder.mkdir()
    bare = {w: bare_cell(args, w, folder / f"bare{w}.json") for w in sorted({c[1] for c in cells.values()})}
    found = {}
    for name, (_, workers, compress) in cells.items():
        summary = trainscale_cell(cell_settings(args, workers, compress, folder / name))
        found[name] = {
            "images_per_sec": throughput(summary),
            "bare_images_per_sec": bare[workers]["images_per_sec"],
            "bytes_per_step": summary.get("bytes_sent_per_step", 0.0) if workers > 1 else 0.0,
            "bare_bytes_per_step": bare[workers]["bytes_per_step"] if workers > 1 else 0.0,
            "test_acc": summary.get("final_test_acc"),
        }
    return found


def cell_row(name: str, cell: tuple[str, int, str | None], rounds: list[dict]) -> dict:
    """A cell's figures over the rounds: images/s of each side (each round's, mean, spread), the median of the
    rounds' ratios, the bytes per step (the same every round)."""
    ours, bare = ([r[k] for r in rounds] for k in ("images_per_sec", "bare_images_per_sec"))
    ratios = [a / b for a, b in zip(ours, bare)]
    return {
        "cell": name,
        "label": cell[0],
        "workers": cell[1],
        "images_per_sec": spread(ours),
        "bare_images_per_sec": spread(bare),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "bytes_per_step": rounds[-1]["bytes_per_step"],
        "bare_bytes_per_step": rounds[-1]["bare_bytes_per_step"],
        "test_acc": [r["test_acc"] for r in rounds],
    }


def spread(values: list[float]) -> dict[str, Any]:
    mean, stdev = mean_and_spread(values)
    return {"each": values, "mean": mean, "stdev": stdev}


def print_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    print(f"{MODEL} {model_args(args)}, {OPTIMIZER}, batch {args.batch} per worker, {args.steps} steps per epoch, "
          f"{args.repeats} round(s): images/s mean +- spread, the median of the rounds' ratios")  # fmt: skip
    print(f"{'cell':<16} {'img/s':>14} {'bare img/s':>14} {'ratio':>6} {'bytes/step':>11} {'bare bytes':>11}")
    for r in rows:
        ours, bare = (f"{r[k]['mean']:.1f} +- {r[k]['stdev']:.1f}" for k in ("images_per_sec", "bare_images_per_sec"))
        print(
            f"{r['label']:<16} {ours:>14} {bare:>14} {r['ratio']:>6.3f} "
            f"{r['bytes_per_step']:>11.0f} {r['bare_bytes_per_step']:>11.0f}"
        )


if __name__ == "__main__":
    run_script(main)
