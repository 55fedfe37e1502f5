"""Muon's optimizer step on airbench94's filters: one Muon per filter against the batched Muon, eager or compiled.

Per parameter is one torch.optim.Muon per filter, the way trainscale stepped them before; the batched Muon
(train.muon) stacks the filters per shape or pads them into one batch, each eager or compiled. All in one process,
one after another, so the ratios compare like with like; the machine is printed, and the figures are saved with the
settings and the environment (``--out``).

    .venv/bin/python benchmarks/muon_step.py                      # CPU
    .venv/bin/python benchmarks/muon_step.py --device cuda --compile
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from trainscale.bench.script import COUNT, device_name, run_script
from trainscale.bench.timing import save_result
from trainscale.errors import OneLineParser
from trainscale.models.airbench import airbench94
from trainscale.train.environment import environment
from trainscale.train.muon import BatchedMuon
from trainscale.train.optimizers import MUON_NS_STEPS, matrix


def per_parameter(views: list[nn.Parameter]) -> Callable[[], None]:
    muons = [torch.optim.Muon([v], lr=0.1, momentum=0.6, weight_decay=0.0, ns_steps=MUON_NS_STEPS) for v in views]

    def step() -> None:
        for m in muons:
            m.step()

    return step


def batched(views: list[nn.Parameter], stacking: str, compiled: bool) -> Callable[[], None]:
    muon = BatchedMuon([tuple(v.shape) for v in views], MUON_NS_STEPS, stacking=stacking, compile=compiled)
    buffers = [torch.zeros_like(v) for v in views]
    grads = [v.grad for v in views if v.grad is not None]

    def step() -> None:
        muon.step(views, grads, buffers, 0.1, momentum=0.6)

    return step


def timed(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of one step, after two warm-up steps (compilation)."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--repeats", type=COUNT, default=20, help="timed steps per variant (median reported)")
    parser.add_argument("--compile", action="store_true", help="also time the compiled variants")
    parser.add_argument("--out", type=Path, default=Path(f"runs/bench/muon_step-{time.strftime('%Y%m%d-%H%M%S')}.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    machine = env["device_name"] if device.type == "cuda" else f"{env['cpu']}, {env['cpu_count']} CPUs"
    model = airbench94().to(device).to(memory_format=torch.channels_last)
    views = [
        nn.Parameter(matrix(p.detach(), p), requires_grad=False)
        for p in model.parameters()
        if p.ndim == 4 and p.requires_grad
    ]
    for v in views:
        v.grad = torch.randn_like(v)
    variants = {"per parameter": per_parameter(views)}
    for compiled in (False, True) if args.compile else (False,):
        for stacking in ("shape", "pad"):
            variants[f"batched, {stacking}{', compiled' if compiled else ''}"] = batched(views, stacking, compiled)
    results = {name: timed(step, device, args.repeats) for name, step in variants.items()}
    base = results["per parameter"]
    print(f"Muon step over airbench94's {len(views)} filters on {machine} (median of {args.repeats})")
    for name, seconds in results.items():
        print(f"  {name:<26} {1000 * seconds:8.2f} ms   {base / seconds:5.2f}x per parameter's speed")
    scope = f"one step over {len(views)} filters, device-synchronised, median of {args.repeats} after 2 warm-up steps"
    figures = {name: {"median_seconds": s, "speed_over_per_parameter": base / s} for name, s in results.items()}
    save_result(args.out, {"config": vars(args), "environment": env, "timer_scope": scope, "results": figures})
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    run_script(main)
