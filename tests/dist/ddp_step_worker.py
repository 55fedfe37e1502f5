"""Worker for tests/dist/test_ddp_step.py, started by torch.distributed.run with 2 processes over gloo.

For the dense counting hook and for a bf16-compressed one, the same BatchNorm-free DDP model takes its steps
through the training loop's ``compute_gradients``/``apply_gradients``: once as 4 accumulated micro-batches
of 8 images per rank, once as one batch of 32 per rank; and, with Top-k and error feedback too, three steps
eager and three through the compiled step (``train.step.compiled_step`` of the DDP model, the ``aot_eager``
backend). Writes ``<out>/rank<r>.json`` with each run's final parameters and the hook's counts (bytes,
collective calls, steps).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainscale.compression import CompressionHookState, compression_hook, create_compressor
from trainscale.runtime.comm_hooks import HookState, counting_allreduce_hook, register_hook
from trainscale.runtime.process_group import process_group
from trainscale.train.loop import apply_gradients, compute_gradients
from trainscale.train.precision import Precision
from trainscale.train.step import compiled_step

MICRO = 4


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(128, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def hooked(model: nn.Module, hook: str, **ddp: Any) -> tuple[DDP, Any]:
    wrapped = DDP(model, **ddp)
    if hook == "dense":
        state: Any = HookState()
        register_hook(wrapped, state, counting_allreduce_hook)
    else:
        compressor = create_compressor(hook, ratio=0.1) if hook == "topk" else create_compressor(hook)
        state = CompressionHookState(compressor, "layerwise", model=wrapped, error_feedback=hook == "topk")
        wrapped.register_comm_hook(state, compression_hook)
    return wrapped, state


def one_step(hook: str, accumulate: int) -> dict[str, Any]:
    model = tiny_model()
    ddp, state = hooked(model, hook, bucket_cap_mb=0.001)  # several buckets: a missed no_sync shows as extra calls
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    precision = Precision("fp32", torch.device("cpu"))
    scaler = precision.grad_scaler()
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    images, labels = torch.randn(32, 3, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    for _ in range(2):  # the second step runs with DDP's rebuilt buckets
        compute_gradients(ddp, images, labels, optimizer, scaler, precision, accumulate=accumulate)
        apply_gradients(optimizer, scaler)
    stats = state.stats
    return {
        "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "bytes": stats.bytes_sent,
        "calls": stats.calls,
        "steps": stats.steps,
    }


def three_steps(hook: str, compiled: bool) -> dict[str, Any]:
    """DDP's default buckets: dynamo's DDP graph splitting wants a first bucket no larger than the others."""
    model = tiny_model()
    ddp, state = hooked(model, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    precision = Precision("fp32", torch.device("cpu"))
    scaler = precision.grad_scaler()
    step = compiled_step(ddp, optimizer, precision, 0.0, graphed=False, backend="aot_eager") if compiled else None
    gen = torch.Generator().manual_seed(200 + dist.get_rank())
    for _ in range(3):
        images, labels = torch.randn(32, 3, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        if step is not None:
            step(images, labels)
        else:
            compute_gradients(ddp, images, labels, optimizer, scaler, precision)
            apply_gradients(optimizer, scaler)
    stats = state.stats
    return {
        "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "bytes": stats.bytes_sent,
        "calls": stats.calls,
        "steps": stats.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    with process_group(torch.device("cpu"), "gloo", 60.0):
        result: dict[str, Any] = {}
        for hook in ("dense", "bf16"):
            try:
                result[hook] = {"micro": one_step(hook, MICRO), "whole": one_step(hook, 1)}
            except Exception:
                result[hook] = {"error": traceback.format_exc()}
        for hook in ("dense", "topk"):
            try:
                result["compiled-" + hook] = {"eager": three_steps(hook, False), "compiled": three_steps(hook, True)}
            except Exception:
                result["compiled-" + hook] = {"error": traceback.format_exc()}
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
