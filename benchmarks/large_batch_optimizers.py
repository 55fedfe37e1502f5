"""Large-batch optimizers: LARS (or LAMB) against SGD at the same global batch, same model, epochs and schedule.

Each run is ``trainscale train`` through the CLI, in this invocation, one after the other, on real data (set
TRAINSCALE_DATA); it prints the test accuracy of each side by side (accuracy, not speed: CPU contention only slows
it). Defaults: ResNet-20 on CIFAR-10, batch 1024, 2 epochs, cosine with 0.3 warm-up epoch, no decay for biases and
norms; SGD at lr 0.8 (0.1 per 128, linear scaling), LARS at lr 10 (trust coefficient 0.001: 1% of each layer's norm
per step at the peak).

    .venv/bin/python benchmarks/large_batch_optimizers.py --out runs/large-batch
    .venv/bin/python benchmarks/large_batch_optimizers.py --set train_subset=10000 --set test_subset=2000 --out runs/lb
    .venv/bin/python benchmarks/large_batch_optimizers.py --run lamb:0.02 --out runs/lb-lamb
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainscale.app.worker_env import to_argv
from trainscale.bench.grid import GridError, parse_sets, set_argument
from trainscale.bench.script import check_run, run_child, run_script
from trainscale.errors import ConfigError, OneLineParser
from trainscale.train.optim import optimizer_info


def optimizer_and_lr(text: str) -> tuple[str, str]:
    """``--run OPTIMIZER:LR``, checked when the command line is read: a known optimizer (or an import path) and a
    positive learning rate."""
    name, sep, lr = text.rpartition(":")
    try:
        ok = bool(sep and name) and float(lr) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"give OPTIMIZER:LR with a positive LR, e.g. lars:10, got {text!r}")
    try:
        optimizer_info(name)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, lr


COMMON = dict(model="resnet20", dataset="cifar10", epochs=2, batch_size=1024, schedule="cosine", warmup_epochs=0.3)


def run_settings(settings: dict[str, Any], name: str, lr: str, args: argparse.Namespace) -> dict[str, Any]:
    """One optimizer's `trainscale train` settings (``trainscale.fit``'s keywords), in a folder of its own."""
    decay = {} if args.decay_everything else {"no_decay_norm_bias": True}
    out = Path(args.out) / f"{name}-lr{lr}"
    return {**settings, **decay, "progress": False, "optimizer": name, "lr": float(lr), "out": str(out)}


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the run folders (one per optimizer)")
    parser.add_argument(
        "--run",
        action="append",
        type=optimizer_and_lr,
        help="OPTIMIZER:LR to compare (repeatable; default sgd:0.8 and lars:10)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        type=set_argument,
        help="KEY=VALUE for both runs (a train flag's name)",
    )
    parser.add_argument(
        "--decay-everything",
        action="store_true",
        help="weight decay (and LARS's trust ratio) on biases and norms too (default: exempt, as LARS users run it)",
    )
    args = parser.parse_args()
    runs = args.run or [("sgd", "0.8"), ("lars", "10")]
    try:
        settings = {**COMMON, **parse_sets(args.set)}
    except GridError as err:
        parser.error(str(err))
    plans = [(name, lr, run_settings(settings, name, lr, args)) for name, lr in runs]
    for name, lr, flags in plans:
        check_run(flags, f"{name} at lr {lr}")
    rows = []
    for name, lr, flags in plans:
        status = run_child([sys.executable, "-m", "trainscale", "train", *to_argv(flags)]).returncode
        if status:
            raise SystemExit(
                f"{name} at lr {lr}: `trainscale train` exited with status {status} (its own message is above)"
            )
        summary = json.loads((Path(flags["out"]) / "summary.json").read_text())
        rows.append((name, lr, summary["final_test_acc"], summary["best_test_acc"], summary["batch_size"]))
    print(f"{'optimizer':<10} {'lr':>6} {'batch':>6} {'final acc':>10} {'best acc':>9}")
    for name, lr, final, best, batch in rows:
        print(f"{name:<10} {lr:>6} {batch:>6} {final:>10.4f} {best:>9.4f}")


if __name__ == "__main__":
    run_script(main)
