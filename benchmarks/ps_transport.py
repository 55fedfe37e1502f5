"""Which transport the parameter server uses: torch RPC (TensorPipe) against gloo point-to-point, measured.

One worker process and one server process on this machine. "rpc" lets TensorPipe choose its transport
(shared memory between processes of one host), "rpc-tcp" forces TensorPipe's TCP transport (what two
hosts would use, here over loopback), "gloo" is blocking send/recv over gloo's TCP pairs. Each round trip is what a PS
step moves: the worker sends a flat fp32 gradient of N floats, the server adds it into its copy and
sends the parameters back. Sizes: ResNet-32 (464,154 floats = 1.86 MB) and ResNet9 (6,573,120 floats
= 26.3 MB). Timer scope: whole round trips seen by the worker, warm-up excluded.

    python benchmarks/ps_transport.py --repeats 20
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from trainscale.bench.script import COUNT, WARMUP, run_script
from trainscale.bench.timing import mean_and_spread, save_result
from trainscale.errors import OneLineParser
from trainscale.runtime.network import free_port
from trainscale.train.environment import environment

SIZES = {"resnet32": 464_154, "resnet9": 6_573_120}
_STATE: dict[str, torch.Tensor] = {}


def _push_pull(grad: torch.Tensor) -> torch.Tensor:
    """Server side of one RPC round trip: apply the gradient, return the parameters."""
    params = _STATE.setdefault(str(grad.numel()), torch.zeros_like(grad))
    params.add_(grad, alpha=-0.01)
    return params


def _rpc_side(rank: int, repeats: int, warmup: int, transports: list[str] | None) -> dict[str, list[float]]:
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=120, _transports=transports)
    rpc.init_rpc(f"p{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out: dict[str, list[float]] = {}
    if rank == 0:
        for name, n in SIZES.items():
            grad = torch.randn(n)
            times = []
            for i in range(warmup + repeats):
                start = time.perf_counter()
                rpc.rpc_sync("p1", _push_pull, args=(grad,))
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            out[name] = times
    rpc.shutdown()
    return out


def _gloo_side(rank: int, repeats: int, warmup: int, transports: None = None) -> dict[str, list[float]]:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out: dict[str, list[float]] = {}
    for name, n in SIZES.items():
        buf = torch.randn(n)
        params = torch.zeros(n)
        times = []
        for i in range(warmup + repeats):
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
                dist.recv(params, src=1)
            else:
                dist.recv(buf, src=0)
                params.add_(buf, alpha=-0.01)
                dist.send(params, dst=0)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        out[name] = times
    dist.destroy_process_group()
    return out


def _entry(rank: int, transport: str, repeats: int, warmup: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if transport == "gloo":
        result = _gloo_side(rank, repeats, warmup)
    else:  # "rpc": TensorPipe picks shared memory on one host; "rpc-tcp" forces its TCP (uv) transport
        result = _rpc_side(rank, repeats, warmup, ["uv"] if transport == "rpc-tcp" else None)
    if rank == 0:
        queue.put(result)


def measure(transport: str, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Start a worker and a server process, return the worker's round-trip times per size."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, transport, repeats, warmup, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=COUNT, default=20)
    parser.add_argument("--warmup", type=WARMUP, default=3)
    parser.add_argument("--out", default="runs/bench/ps_transport.json")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for transport in ("rpc", "rpc-tcp", "gloo"):
        results[transport] = measure(transport, args.repeats, args.warmup)
    print(f"{'size':>10} {'MB':>6} {'transport':>9} {'ms per push+pull':>18}  {'MB/s (both ways)':>16}")
    for name, n in SIZES.items():
        mb = n * 4 / 1e6
        for transport, res in results.items():
            t = res[name]
            mean, sd = mean_and_spread(t)
            print(f"{name:>10} {mb:6.2f} {transport:>9} {1e3 * mean:10.2f} ± {1e3 * sd:5.2f}  {2 * mb / mean:16.0f}")
    save_result(
        Path(args.out),
        {"config": vars(args), "sizes": SIZES, "seconds": results, "environment": environment(torch.device("cpu"))},
    )
    print(f"saved {args.out}")


if __name__ == "__main__":
    run_script(main)
