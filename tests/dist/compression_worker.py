"""Worker for tests/dist/test_compression_ddp.py, started by torch.distributed.run with 2 processes.

For every (compressor, granularity) pair it trains a tiny conv+linear model for a few DDP steps with
the compression hook and records, per rank, the checks the test asserts: finite gradients, identical
parameters on every rank, fewer bytes than dense for compressing methods, agreement with plain DDP
for ``none``, agreement of the DDP hook with the manual reducer, and the byte counts. Writes
``<out>/rank<r>.json``. One launch covers every pair, so the process-group start-up is paid once.
"""

from __future__ import annotations

import argparse
import json
import math
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainscale.compression import (
    CompressionHookState,
    compression_hook,
    create_compressor,
    ddp_kwargs_for,
    list_compressors,
    make_reducer,
)
from trainscale.compression.exchange import DEFAULT_DENSE_BELOW
from trainscale.runtime.process_group import process_group

STEPS = 3
PARAMS: dict[str, dict[str, Any]] = {
    "randomk": {"ratio": 0.05},
    "topk": {"ratio": 0.05},
    "threshold": {"threshold": 0.01},
    "qsgd": {"qstates": 15},
    "powersgd": {"rank": 2, "min_square": 1024},
    "dgc": {"ratio": 0.05, "sparsity_warmup_epochs": 1},
}
DETERMINISTIC = ("none", "fp16", "bf16", "randomk", "topk", "threshold", "signsgd", "efsignsgd", "powersgd", "dgc")


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(256, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 3, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def same_on_all_ranks(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def train_ddp(method: str, granularity: str, bucket_cap_mb: float | None, **kwargs: Any) -> dict[str, Any]:
    """A few DDP steps with the hook; returns the checks and the grads of the last step."""
    model = tiny_model()
    extra = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else ddp_kwargs_for(granularity, model)
    ddp = DDP(model, **extra)
    state = CompressionHookState(
        create_compressor(method, **PARAMS.get(method, {})),
        granularity,
        model=ddp,
        error_feedback=True,
        dense_below=0,
        **kwargs,
    )
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    finite, losses = True, []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        finite &= all(torch.isfinite(p.grad).all().item() for p in ddp.parameters())
        losses.append(loss.item())
        last = grads_of(ddp)
        opt.step()
    summary = state.stats.summary()
    return {
        "finite": finite and all(math.isfinite(v) for v in losses),
        "losses": losses,
        "params_identical": same_on_all_ranks([p.detach() for p in model.parameters()]),
        "grads_identical": same_on_all_ranks(last),
        "stats": summary,
        "bytes_sent": state.stats.bytes_sent,
        "dense_bytes": state.stats.dense_bytes,
        "dense_steps": state.stats.dense_steps,
        "buckets_last_step": state.buckets_last_step,
    }


def path_grads(
    method: str | None, granularity: str, wrap: str, bucket_cap_mb: float | None = 0.01
) -> list[list[torch.Tensor]]:
    """Gradients of two SGD steps through one path: ``wrap`` is "ddp" (the hook, or DDP's own
    all-reduce when ``method`` is None) or "manual" (``make_reducer`` on the unwrapped model).
    DDP rebuilds its buckets after step 0, so step 1 runs with several small buckets."""
    model = tiny_model()
    if wrap == "ddp":
        net = DDP(model, bucket_cap_mb=bucket_cap_mb) if bucket_cap_mb else DDP(model)
        if method is not None:
            state = CompressionHookState(
                create_compressor(method, **PARAMS.get(method, {})),
                granularity,
                model=net,
                error_feedback=True,
                dense_below=0,
            )
            net.register_comm_hook(state, compression_hook)
        reducer = None
    else:
        net = model
        reducer = make_reducer(
            model, method or "none", granularity, error_feedback=True, dense_below=0, **PARAMS.get(method, {})
        )
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    out = []
    for step in range(2):
        x, y = batch(step, dist.get_rank())
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        if reducer is not None:
            reducer.reduce()
        out.append(grads_of(net))
        opt.step()
    return out


def close(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]], atol: float = 1e-6) -> bool:
    return all(torch.allclose(x, y, atol=atol, rtol=1e-5) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def run_case(method: str, granularity: str, reference: list[list[torch.Tensor]]) -> dict[str, Any]:
    # entire model over several small buckets exercises the hook's hold-until-last-bucket path
    result = train_ddp(method, granularity, bucket_cap_mb=0.01 if granularity == "entire" else None)
    if method in DETERMINISTIC:
        hook = path_grads(method, granularity, "ddp")
        result["hook_matches_manual"] = close(hook, path_grads(method, granularity, "manual"))
    if method == "none":
        result["matches_plain_ddp"] = close(path_grads("none", granularity, "ddp", None), reference)
    return result


def reference_topk_ef(
    grads: list[torch.Tensor], residuals: list[torch.Tensor], ratio: float, dense_below: int = 0
) -> list[torch.Tensor]:
    """Layerwise Top-k with error feedback from its definition: each rank sends the top
    max(1, ceil(n * ratio)) of gradient + residual per tensor, keeps the rest; the step is the mean.
    ``dense_below``: 1-D tensors and those under that many elements are averaged whole, with no residual."""
    out = []
    for i, g in enumerate(grads):
        if dense_below and (g.dim() <= 1 or g.numel() < dense_below):
            whole = g.clone()
            dist.all_reduce(whole)
            out.append(whole.div_(dist.get_world_size()))
            continue
        corrected = (g + residuals[i]).reshape(-1)
        k = min(corrected.numel(), max(1, math.ceil(corrected.numel() * ratio - 1e-9)))
        sent = torch.zeros_like(corrected)
        keep = corrected.abs().topk(k).indices
        sent[keep] = corrected[keep]
        residuals[i] = (corrected - sent).view_as(g)
        dist.all_reduce(sent)
        out.append(sent.div_(dist.get_world_size()).view_as(g))
    return out


def topk_layerwise_against_reference(dense_below: int = 0) -> dict[str, Any]:
    """The DDP hook (tiny buckets, rebuilt after step 0; momentum and weight decay) against
    ``reference_topk_ef`` on an unwrapped copy, step by step from the same parameters."""
    ratio = PARAMS["topk"]["ratio"]
    hooked, plain = tiny_model(), tiny_model()
    ddp = DDP(hooked, bucket_cap_mb=0.01)
    state = CompressionHookState(
        create_compressor("topk", ratio=ratio), "layerwise", model=ddp, error_feedback=True, dense_below=dense_below
    )
    ddp.register_comm_hook(state, compression_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4) for m in (ddp, plain)]
    residuals = [torch.zeros_like(p) for p in plain.parameters()]
    equal = []
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        for net, opt in zip((ddp, plain), opts):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
        want = reference_topk_ef([p.grad for p in plain.parameters()], residuals, ratio, dense_below)
        equal.append(all(torch.equal(p.grad, w) for p, w in zip(hooked.parameters(), want)))
        for p, w in zip(plain.parameters(), want):
            p.grad = w
        for opt in opts:
            opt.step()
    return {"equal_per_step": equal, "buckets_last_step": state.buckets_last_step}


def run_extra_cases() -> dict[str, Any]:
    out: dict[str, Any] = {
        "topk_reference/layerwise": topk_layerwise_against_reference(),
        "topk_reference/dense_small": topk_layerwise_against_reference(DEFAULT_DENSE_BELOW),
    }
    # every |g| below the threshold: nothing is selected, nothing may hang, the step is zero
    for granularity in ("layerwise", "entire"):
        model = tiny_model()
        ddp = DDP(model)
        state = CompressionHookState(
            create_compressor("threshold", threshold=1e9), granularity, model=ddp, dense_below=0
        )  # every tensor through the threshold: nothing passes
        ddp.register_comm_hook(state, compression_hook)
        x, y = batch(0, dist.get_rank())
        F.cross_entropy(ddp(x), y).backward()
        out[f"threshold_empty/{granularity}"] = {
            "all_zero": all(bool((p.grad == 0).all()) for p in ddp.parameters()),
            "density": state.stats.summary()["density"],
        }
    warm = train_ddp("topk", "layerwise", None, warmup_steps=1)
    out["topk_warmup"] = {"dense_steps": warm["dense_steps"], "params_identical": warm["params_identical"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", nargs="*", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with process_group(torch.device("cpu"), timeout_s=120):
        reference = path_grads(None, "layerwise", "ddp", None)
        results: dict[str, Any] = {}
        for method in args.methods or list_compressors():
            for granularity in ("layerwise", "entire"):
                try:
                    results[f"{method}/{granularity}"] = run_case(method, granularity, reference)
                except Exception:  # recorded for the test to show, then the next case runs
                    results[f"{method}/{granularity}"] = {"error": traceback.format_exc()}
        results.update(run_extra_cases())
        Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
