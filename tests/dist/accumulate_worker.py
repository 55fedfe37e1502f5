"""Worker for tests/dist/test_accumulate.py, started by torch.distributed.run with 2 processes over gloo.

For the dense counting hook and for a bf16-compressed one, the same BatchNorm-free DDP model takes one optimizer
step through the training loop's ``compute_gradients``/``apply_gradients``: once as 4 accumulated micro-batches
of 8 images per rank, once as one batch of 32 per rank. Writes ``<out>/rank<r>.json`` with each run's final
parameters and the hook's counts (bytes, collective calls, steps) over that one optimizer step.
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

MICRO = 4


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 32),
        nn.ReLU(), nn.Linear(32, 10))


def one_step(hook: str, accumulate: int) -> dict[str, Any]:
    model = tiny_model()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: a missed no_sync shows as extra calls
    if hook == "dense":
        state: Any = HookState()
        register_hook(ddp, state, counting_allreduce_hook)
    else:
        state = CompressionHookState(create_compressor("bf16"), "layerwise", model=ddp, error_feedback=False)
        ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    precision = Precision("fp32", torch.device("cpu"))
    scaler = precision.grad_scaler()
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    images, labels = torch.randn(32, 3, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    for _ in range(2):  # the second step runs with DDP's rebuilt buckets
        compute_gradients(ddp, images, labels, optimizer, scaler, precision, accumulate=accumulate)
        apply_gradients(optimizer, scaler)
    stats = state.stats
    return {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
            "bytes": stats.bytes_sent, "calls": stats.calls, "steps": stats.steps}


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
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
