"""Collectives over emulated links against the ring model: does a shaped cluster behave like the network it claims?

For each host count and rate this script makes an emulated cluster (``runtime.cluster``: namespaces on a bridge,
tc tbf both ways), starts one process per host inside its namespace (joined through trainscale's own
``process_group()``, so gloo binds the host's eth0), and times on rank 0:

- a gloo all-reduce of a ResNet-9-sized fp32 gradient (6,573,120 values, 26.3 MB), against the ring model
  2(W-1)/W x bytes / rate;
- an all-gather of one Top-k 1% payload per worker (65,731 fp32 values + int32 indices = 526 KB), against
  (W-1) x payload / rate.

Timer scope: one collective, from a barrier that lines the ranks up to its return on rank 0; the first of
each kind is a warm-up (connection set-up) and excluded; mean and spread over ``--repeats``. The model counts
payload bytes only (no TCP/IP headers, about 0.1-0.5%) and assumes every link runs at its rate all the time.
Each cluster is deleted afterwards, also on failure or Ctrl-C. Needs root, ``ip`` and ``tc``.

    sudo .venv/bin/python benchmarks/cluster_links.py --hosts 2,3,4 --rates 100mbit,500mbit,1gbit --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainscale.bench.script import COUNT, run_script
from trainscale.errors import OneLineParser

RESNET9_FLOATS = 6_573_120
PORT = 29500


def worker(args: argparse.Namespace) -> None:
    """One host's process: join the group, time the collectives, rank 0 prints them as JSON."""
    import torch
    import torch.distributed as dist

    from trainscale.runtime.process_group import process_group

    os.environ.update(
        RANK=str(args.rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(args.world),
        MASTER_ADDR=args.master,
        MASTER_PORT=str(PORT),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    k = int(RESNET9_FLOATS * args.ratio)
    grad = torch.randn(RESNET9_FLOATS)
    payload = torch.empty(2 * k, dtype=torch.int32)  # k fp32 values and k int32 indices, as Top-k sends them
    with process_group(torch.device("cpu"), "gloo", timeout_s=600):
        out = {"allreduce": [], "allgather": []}
        gathered = [torch.empty_like(payload) for _ in range(args.world)]
        for i in range(args.repeats + 1):
            for name, op in (
                ("allreduce", lambda: dist.all_reduce(grad)),
                ("allgather", lambda: dist.all_gather(gathered, payload)),
            ):
                dist.barrier()
                start = time.perf_counter()
                op()
                if i:
                    out[name].append(time.perf_counter() - start)
        if args.rank == 0:
            print(json.dumps({**out, "allreduce_bytes": grad.numel() * 4, "allgather_bytes": payload.numel() * 4}))


def run_cell(hosts: int, rate: int, args: argparse.Namespace) -> dict:
    from trainscale.runtime import cluster as net

    name = f"bl{os.getpid() % 100000}"
    cluster = net.Cluster(name, (rate,) * hosts)
    net.create(cluster)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(hosts):
            argv = [
                sys.executable,
                __file__,
                "--worker",
                "--rank",
                str(rank),
                "--world",
                str(hosts),
                "--master",
                net.address(0),
                "--repeats",
                str(args.repeats),
                "--ratio",
                str(args.ratio),
            ]
            procs.append(subprocess.Popen(net.in_namespace(name, rank, argv), stdout=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a worker failed at {hosts} hosts, {net.format_rate(rate)}")
        return json.loads(outputs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        net.destroy(name)


def models(result: dict, hosts: int, rate: int) -> dict[str, float]:
    """Seconds the ring model gives each collective at ``rate`` bit/s."""
    return {
        "allreduce": 2 * (hosts - 1) / hosts * result["allreduce_bytes"] * 8 / rate,
        "allgather": (hosts - 1) * result["allgather_bytes"] * 8 / rate,
    }


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,3,4")
    parser.add_argument("--rates", default="100mbit,500mbit,1gbit")
    parser.add_argument("--repeats", type=COUNT, default=5)
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-k density of the all-gather payload")
    parser.add_argument("--save", type=Path, default=Path("runs/bench-cluster-links.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import torch

    from trainscale.bench.timing import mean_and_spread, save_result
    from trainscale.runtime import cluster as net
    from trainscale.train.environment import environment

    net.check_tools()
    rates = net.parse_rates(args.rates, len(args.rates.split(",")))
    cells = []
    print(f"{'hosts':>5} {'rate':>8} {'collective':>10} {'measured s':>16} {'model s':>8} {'measured/model':>14}")
    for hosts in map(int, args.hosts.split(",")):
        for rate in rates:
            result = run_cell(hosts, rate, args)
            for name, model in models(result, hosts, rate).items():
                seconds = result[name]
                mean, spread = mean_and_spread(seconds)
                cells.append(
                    {
                        "hosts": hosts,
                        "rate_bps": rate,
                        "collective": name,
                        "seconds": seconds,
                        "model_seconds": model,
                        "ratio": mean / model,
                    }
                )
                print(
                    f"{hosts:>5} {net.format_rate(rate):>8} {name:>10} {mean:>9.3f} ± {spread:<5.3f}"
                    f" {model:>8.3f} {mean / model:>14.2f}",
                    flush=True,
                )
    env = environment(torch.device("cpu"))
    print(f"machine: {env.get('cpu')}, {env.get('cpu_count')} cores")
    save_result(args.save, {"config": vars(args), "environment": env, "cells": cells})
    print(f"saved {args.save}")


if __name__ == "__main__":
    run_script(main)
