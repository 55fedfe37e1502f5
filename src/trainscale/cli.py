"""The `trainscale` command: a thin layer that turns flags into configs and calls the packages.

User errors (bad flags, bad files, missing data) print one line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from trainscale.errors import TrainscaleError

log = logging.getLogger("trainscale")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def _flag(parser: argparse.ArgumentParser, name: str, help: str, **kw: Any) -> None:
    parser.add_argument(name, default=argparse.SUPPRESS, help=help, **kw)


def _switch(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Every TrainConfig field as a flag; absent flags fall back to --config, then to the defaults."""
    _flag(p, "--config", "TOML file with the same keys as these flags (flags given here win)")
    g = p.add_argument_group("model and data")
    _flag(g, "--model", "model name (see `trainscale models`)")
    _flag(g, "--dataset", "cifar10, cifar100, imagefolder or synthetic")
    _flag(g, "--data-dir", "folder holding the dataset (else $TRAINSCALE_DATA, else ~/.cache/trainscale)")
    _switch(g, "--verify", "check every data file's size and MD5 (default on)")
    _switch(g, "--download", "download the dataset when it is absent (default on)")
    _flag(g, "--train-subset", "train on the first N training images", type=int)
    _flag(g, "--test-subset", "evaluate on the first N test images", type=int)
    _flag(g, "--image-size", "input size; default: the model's (CIFAR is cropped or upscaled to it)", type=int)
    _flag(g, "--crop-padding", "pad-and-random-crop padding in pixels (default 4)", type=int)
    _switch(g, "--flip", "random horizontal flips (default on)")
    _flag(g, "--cutout", "Cutout square size, 0 = off (cifar10-fast uses 8)", type=int)
    g = p.add_argument_group("optimisation")
    _flag(g, "--epochs", "number of epochs", type=int)
    _flag(g, "--batch-size", "global batch size, split across workers", type=int)
    _flag(g, "--batch-per-worker", "batch per worker instead (global = this x workers)", type=int)
    _flag(g, "--lr", "peak/base learning rate", type=float)
    _flag(g, "--lr-scaling", "'linear': lr x global batch / --base-batch-size (Goyal et al.)", choices=["none", "linear"])
    _flag(g, "--base-batch-size", "batch size the --lr was tuned for (linear scaling)", type=int)
    _flag(g, "--momentum", "SGD momentum", type=float)
    _switch(g, "--nesterov", "Nesterov momentum")
    _flag(g, "--weight-decay", "L2 weight decay", type=float)
    _flag(g, "--schedule", "onecycle, step, cosine or constant")
    _flag(g, "--warmup-epochs", "linear warm-up length (onecycle: the peak epoch)", type=float)
    _flag(g, "--milestones", "step schedule: 1-based epochs where lr *= gamma, e.g. 41,61", type=_ints)
    _flag(g, "--gamma", "step schedule factor", type=float)
    _flag(g, "--label-smoothing", "label smoothing", type=float)
    _switch(g, "--tta", "flip test-time augmentation at evaluation")
    g = p.add_argument_group("execution")
    _flag(g, "--precision", "fp32, bf16 (autocast) or fp16 (CUDA, with a grad scaler)", choices=["fp32", "bf16", "fp16"])
    _switch(g, "--channels-last", "channels_last memory format (default on)")
    _switch(g, "--compile", "torch.compile the model")
    _flag(g, "--device", "auto, cpu, cuda or cuda:N")
    _flag(g, "--threads", "torch intra-op threads", type=int)
    _flag(g, "--seed", "random seed (model init, data order, augmentation)", type=int)
    _flag(g, "--mode", "auto (default: sync when several workers, async with --servers, else local), local, sync, "
          "or a parameter-server mode: async, ps-sync, ma")
    _flag(g, "--target-acc", "test accuracy (fraction) whose first crossing gives time-to-accuracy", type=float)
    _flag(g, "--out", "run folder (default runs/<model>-<dataset>-<time>)")
    _switch(g, "--resume", "continue the run in --out from its last checkpoint")
    _switch(g, "--checkpoint", "write a checkpoint every epoch (default on)")
    _switch(g, "--progress", "progress bar (default on)")
    add_parallel_flags(p)
    add_ps_flags(p)
    add_compression_flags(p)


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Synchronous data parallelism: local workers through torch's elastic agent, nodes over c10d."""
    g = p.add_argument_group("data parallel (sync mode)")
    _flag(g, "--workers", "worker processes on this node (default 1, or one per --devices GPU)", type=int)
    _flag(g, "--nnodes", "number of machines (each runs the same command with its own --node-rank)", type=int)
    _flag(g, "--node-rank", "this machine's index, 0..nnodes-1; node 0 hosts the rendezvous and the run folder",
          type=int)
    _flag(g, "--rdzv-endpoint", "HOST:PORT of the c10d rendezvous on node 0 (single node: a free local port)")
    _flag(g, "--rdzv-id", "job id shared by all nodes (default: 'trainscale' for several nodes)")
    _flag(g, "--rdzv-timeout", "seconds to wait for all nodes to join, and for node 0's endpoint", type=float)
    _flag(g, "--hosts", "file with one host per line ('host' or 'host slots=N'): print the per-node commands")
    _switch(g, "--ssh", "with --hosts: run the per-node commands over ssh instead of printing them")
    g.add_argument("--devices", "--gpus", dest="devices", type=_ints, default=argparse.SUPPRESS,
                   help="GPU indices, one worker per GPU, e.g. 0,1,2,3 (sets CUDA_VISIBLE_DEVICES)")
    _switch(g, "--sync-bn", "SyncBatchNorm (CUDA) instead of per-worker BN statistics averaged each epoch")
    _flag(g, "--backend", "auto (nccl on CUDA, gloo on CPU), gloo or nccl", choices=["auto", "gloo", "nccl"])
    _flag(g, "--max-restarts", "let the elastic agent restart failed workers N times; they resume from the "
          "last finished epoch's checkpoint", type=int)
    _flag(g, "--dist-timeout", "seconds any collective may wait for a peer before the job fails", type=float)
    _flag(g, "--baseline", "a previous 1-worker run folder: summary.json gets scaling_efficiency against it")


def add_ps_flags(p: argparse.ArgumentParser) -> None:
    """Parameter-server modes: shards beside the workers in the same launcher job."""
    g = p.add_argument_group("parameter server (--mode async, ps-sync, ma)")
    _flag(g, "--servers", "parameter-server shards per node, started beside --workers (same launcher)", type=int)
    _flag(g, "--staleness", "async: a worker more than K steps ahead of the slowest waits (default: unbounded)",
          type=int)
    _flag(g, "--average-every", "ma: average the workers' parameters every STEPS steps (default 4)", type=int)
    _flag(g, "--warm-start-epochs", "train on the main worker alone for the first E epochs (default 0)", type=int)
    _flag(g, "--rpc-timeout", "seconds a push or pull may take before the worker stops with an error", type=float)


def add_compression_flags(p: argparse.ArgumentParser) -> None:
    """Compressed gradient exchange in sync mode; seed 004's -K/-V/-Q and --method spellings work too."""
    g = p.add_argument_group("compressed communication (sync mode)")
    _flag(g, "--compress", "none, fp16, bf16, randomk, topk, threshold, terngrad, qsgd, signsgd, efsignsgd, "
          "powersgd, dgc (or seed 004's layerwise/entiremodel, meaning --granularity)")
    _flag(g, "--method", "the compression method (seed 004's name for --compress METHOD)")
    _flag(g, "--granularity", "layerwise (each tensor on its own) or entire (all gradients as one vector)")
    for short, long, kind, text in (("-K", "--ratio", float, "fraction of elements kept: randomk, topk, dgc"),
                                    ("-V", "--threshold", float, "threshold: send every element with |g| >= V"),
                                    ("-Q", "--qstates", int, "qsgd: quantisation levels S")):
        g.add_argument(short, long, type=kind, default=argparse.SUPPRESS, help=text)
    _flag(g, "--powersgd-rank", "powersgd: rank r of the factors", type=int)
    _switch(g, "--error-feedback", "keep what compression dropped and add it to the next step's gradient")
    _flag(g, "--compress-warmup-epochs", "train dense for the first E epochs, then compress", type=int)


def build_parser() -> Parser:
    parser = Parser(prog="trainscale", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_train_flags(sub.add_parser("train", help="train a model and write a run folder"))
    sub.add_parser("models", help="list the registered models with parameter counts and input sizes")
    data = sub.add_parser("data", help="check or fetch datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    for name, text in (("verify", "check the dataset files' sizes and MD5 checksums"),
                       ("download", "download and verify the official archive")):
        d = data_sub.add_parser(name, help=text)
        d.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
        d.add_argument("--data-dir", default=None, help="target folder (else $TRAINSCALE_DATA, else ~/.cache)")
    from trainscale.bench.cli import add_bench_parser
    from trainscale.report.cli import add_report_parser

    add_bench_parser(sub.add_parser("bench", help="run a benchmark grid (each run a `trainscale train`), resumably"))
    add_report_parser(sub.add_parser("report", help="tables, plots and an HTML page from grid or run folders"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from trainscale.log import setup_logging

    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        from trainscale import commands

        return commands.dispatch(args)
    except TrainscaleError as exc:
        print(f"trainscale {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainscale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
