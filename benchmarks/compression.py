"""Payload bytes and encode+decode time of every compressor on ResNet9's real gradients.

One real backward pass of ResNet9 on a random CIFAR-sized batch gives the gradients (25 tensors,
6,573,120 fp32 values). For each method and granularity (layerwise: each tensor on its own; entire:
one flat vector) this measures the bytes of the payloads that would travel (and what the exchange
layer hands to collectives, which adds size exchanges for Threshold-v), their ratio to dense fp32,
the ratio to the method's theoretical size, and encode+decode milliseconds for one worker's step.

Speed is judged against references timed in the same interleaved run: for each method the fastest
plain way we know to compute the same payload from the same gradients (``REFERENCES``), and the
manual reducer without compression against one copy of the gradients. A method passes within 1.2x.

Timer scope: encode + decode of all units of one step on this process (decode once: at W workers an
all-gather method decodes W payloads); repeats interleaved across methods and references, warm-up
excluded, device-synchronised. Pass/fail against the issue's targets is printed for the methods that
have one.

    python benchmarks/compression.py --repeats 7 --threads 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainscale.bench.script import COUNT, WARMUP, model_name, run_script
from trainscale.bench.timing import paired_ratios, save_result, time_interleaved
from trainscale.compression import CompressionStats, Exchange, UnitContext, create_compressor, list_compressors
from trainscale.compression.methods import count_for
from trainscale.compression.reducer import make_reducer
from trainscale.errors import OneLineParser
from trainscale.models import create_model
from trainscale.train.environment import environment

# method -> (minimum ratio to dense fp32, the wording)
TARGETS = {
    "topk": (45.0, "Top-k 1% >= 45x"),
    "randomk": (90.0, "shared-seed Random-k 1% >= 90x"),
    "terngrad": (14.0, "TernGrad >= 14x"),
    "signsgd": (28.0, "signSGD >= 28x"),
    "qsgd": (3.5, "QSGD S=255 >= 3.5x"),
}


def real_gradients(model_name: str, batch: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = create_model(model_name).to(device)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    F.cross_entropy(model(x), y).backward()
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]


def method_params(method: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "randomk": {"ratio": args.ratio},
        "topk": {"ratio": args.ratio},
        "dgc": {"ratio": args.ratio},
        "threshold": {"threshold": args.threshold},
        "qsgd": {"qstates": args.qstates},
        "powersgd": {"rank": args.powersgd_rank},
    }.get(method, {})


def units_for(grads: list[tuple[str, torch.Tensor]], granularity: str) -> list[tuple[str, torch.Tensor]]:
    if granularity == "layerwise":
        return grads
    return [("entire", torch.cat([g.reshape(-1) for _, g in grads]))]


EPOCH = 10**6  # past every warm-up, so DGC runs at its target density
SPEED_LIMIT = 1.2  # a method may take this many times its reference


def ref_topk(units: list[tuple[str, torch.Tensor]], ratio: float) -> Callable[[], None]:
    """One ``torch.topk`` of |g| per unit, values + int32 indices, decoded by a scatter."""

    def run() -> None:
        for _, g in units:
            flat = g.reshape(-1)
            idx = flat.abs().topk(count_for(flat.numel(), ratio), sorted=False).indices
            values, sent = flat[idx], idx.to(torch.int32)
            torch.zeros_like(flat).index_put_((sent.long(),), values)

    return run


def ref_dgc(units: list[tuple[str, torch.Tensor]], ratio: float) -> Callable[[], None]:
    """DGC as its paper's implementation computes it: momentum and accumulation, a threshold estimated
    from a 1% random sample, the top k of the elements above it (fewer than k when the sample
    overestimated the threshold)."""
    state = {key: (torch.zeros_like(g).reshape(-1), torch.zeros_like(g).reshape(-1)) for key, g in units}

    def run() -> None:
        for key, g in units:
            u, v = state[key]
            u.mul_(0.9).add_(g.reshape(-1))
            v.add_(u)
            magnitudes = v.abs()
            n, k = v.numel(), count_for(v.numel(), ratio)
            sample = magnitudes[torch.randint(n, (max(1, n // 100),))]
            threshold = sample.topk(max(1, math.ceil(sample.numel() * ratio)), sorted=False).values.min()
            idx = (magnitudes >= threshold).nonzero().reshape(-1)
            if idx.numel() > k:
                idx = idx[magnitudes[idx].topk(k, sorted=False).indices]
            values, sent = v[idx], idx.to(torch.int32)
            v[idx] = 0
            u[idx] = 0
            torch.zeros_like(v).index_put_((sent.long(),), values)

    return run


def ref_randomk(units: list[tuple[str, torch.Tensor]], ratio: float) -> Callable[[], None]:
    """k indices from one ``torch.randint`` (with replacement: duplicates allowed), gather, scatter."""

    def run() -> None:
        for _, g in units:
            flat = g.reshape(-1)
            idx = torch.randint(flat.numel(), (count_for(flat.numel(), ratio),))
            torch.zeros_like(flat).index_put_((idx,), flat[idx])

    return run


def ref_sign(units: list[tuple[str, torch.Tensor]], ratio: float) -> Callable[[], None]:
    """Mean |g| and the signs packed 8 per byte by numpy's ``packbits``; ``unpackbits`` to decode."""

    def run() -> None:
        for _, g in units:
            flat = g.reshape(-1)
            scale = flat.abs().mean()
            packed = np.packbits((flat >= 0).numpy(), bitorder="little")
            bits = torch.from_numpy(np.unpackbits(packed, count=flat.numel(), bitorder="little"))
            torch.where(bits.view(torch.bool), scale, -scale)

    return run


REFERENCES: dict[str, tuple[str, Callable[..., Callable[[], None]]]] = {
    "topk": ("torch.topk per unit", ref_topk),
    "dgc": ("sampled-threshold DGC", ref_dgc),
    "randomk": ("torch.randint + gather", ref_randomk),
    "signsgd": ("numpy packbits", ref_sign),
    "efsignsgd": ("numpy packbits", ref_sign),
}


def encode_decode(compressor, units: list[tuple[str, torch.Tensor]]) -> Callable[[], None]:
    counter = iter(range(10**9))

    def run() -> None:
        step = next(counter)
        for key, g in units:
            compressor.decode(compressor.encode(g, UnitContext(key, step, EPOCH)))

    return run


def measure_bytes(method: str, params: dict[str, Any], units: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    compressor = create_compressor(method, **params)
    payloads = [compressor.encode(g, UnitContext(k, 0, EPOCH)) for k, g in units]
    dense = sum(g.numel() * g.element_size() for _, g in units)
    payload_bytes = sum(p.nbytes for p in payloads)
    selected = [p.selected for p in payloads if p.selected is not None]
    theory = sum(compressor.theoretical_nbytes(g.numel(), tuple(g.shape)) for _, g in units)
    if method == "threshold":  # its size is data-dependent: theory is 8 bytes per selected element
        theory = 8.0 * sum(selected)
    stats = CompressionStats()
    Exchange(create_compressor(method, **params), stats=stats).reduce(units, 0, EPOCH)
    return {
        "dense_bytes": dense,
        "payload_bytes": payload_bytes,
        "exchange_bytes": stats.bytes_sent,
        "collectives": stats.calls,
        "ratio": dense / payload_bytes if payload_bytes else math.inf,
        "theory_bytes": theory,
        "ratio_to_theory": payload_bytes / theory if theory else None,
        "density": sum(selected) / sum(g.numel() for _, g in units) if selected else None,
    }


def verdict(method: str, ratio: float) -> str:
    if method not in TARGETS:
        return ""
    need, _ = TARGETS[method]
    return f"{'PASS' if ratio >= need else 'FAIL'} (>= {need:g}x)"


def print_row(r: dict[str, Any]) -> None:
    t = r["timing"]
    density = f"{r['density']:.4f}" if r["density"] is not None else "-"
    to_theory = f"{r['ratio_to_theory']:.4f}" if r["ratio_to_theory"] else "-"
    print(
        f"{r['method']:>10} {r['granularity']:>9} {r['payload_bytes']:>12,} {r['exchange_bytes']:>12,} "
        f"{r['ratio']:>8.2f}x {to_theory:>8} {density:>8} {1e3 * t.mean:>9.1f} ± {1e3 * t.stdev:<6.1f} "
        f"{r['verdict']}"
    )


def parse_args() -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=model_name, default="resnet9")
    p.add_argument("--batch", type=COUNT, default=64)
    p.add_argument("--methods", nargs="+", default=list_compressors())
    p.add_argument("--granularities", nargs="+", default=["layerwise", "entire"])
    p.add_argument("--ratio", type=float, default=0.01, help="Top-k / Random-k / DGC density")
    p.add_argument("--threshold", type=float, default=0.001, help="Threshold-v's V (seed 004's default)")
    p.add_argument("--qstates", type=COUNT, default=255)
    p.add_argument("--powersgd-rank", type=COUNT, default=2)
    p.add_argument("--repeats", type=COUNT, default=7)
    p.add_argument("--warmup", type=WARMUP, default=1)
    p.add_argument("--threads", type=COUNT, default=2, help="torch intra-op threads")
    p.add_argument("--out", default=f"runs/bench/compression-{time.strftime('%Y%m%d-%H%M%S')}.json")
    return p.parse_args()


def measure_all(
    args: argparse.Namespace, grads: list[tuple[str, torch.Tensor]]
) -> tuple[list[dict[str, Any]], dict[str, Callable[[], None]]]:
    """Byte figures per (method, granularity), and the encode+decode callables to time."""
    rows, fns = [], {}
    for method in args.methods:
        for granularity in args.granularities:
            units = units_for(grads, granularity)
            params = method_params(method, args)
            row = {
                "method": method,
                "granularity": granularity,
                "params": params,
                **measure_bytes(method, params, units),
            }
            row["verdict"] = verdict(method, row["ratio"])
            rows.append(row)
            fns[f"{method}/{granularity}"] = encode_decode(create_compressor(method, **params), units)
            if method in REFERENCES:
                fns[f"ref:{method}/{granularity}"] = REFERENCES[method][1](units, args.ratio)
    return rows, fns


def reducer_fns(model_name: str, grads: list[tuple[str, torch.Tensor]]) -> dict[str, Callable[[], None]]:
    """The manual reducer without compression in a world of one, and one copy of all gradients."""
    model = create_model(model_name)
    for (_, g), p in zip(grads, model.parameters()):
        p.grad = g.clone()
    reducer = make_reducer(model, "none")
    flat = [g for _, g in grads]
    return {"reducer:none": reducer.reduce, "ref:reducer:none": lambda: [g.clone() for g in flat]}


def speed_rows(rows: list[dict[str, Any]], timings: dict[str, Any]) -> list[dict[str, Any]]:
    """Each method with a reference: its time, the reference's, and the median paired ratio."""
    out = []
    pairs = [
        (f"{r['method']}/{r['granularity']}", REFERENCES[r["method"]][0]) for r in rows if r["method"] in REFERENCES
    ] + [("reducer:none", "one copy of the gradients")]
    for key, reference in pairs:
        ours, ref = timings[key], timings[f"ref:{key}"]
        ratio = statistics.median(paired_ratios(ours, ref))
        out.append(
            {
                "what": key,
                "reference": reference,
                "ms": 1e3 * ours.mean,
                "ms_stdev": 1e3 * ours.stdev,
                "reference_ms": 1e3 * ref.mean,
                "reference_ms_stdev": 1e3 * ref.stdev,
                "ratio": ratio,
                "verdict": "PASS" if ratio <= SPEED_LIMIT else "FAIL",
            }
        )
    return out


def print_speed(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'encode+decode':>20} {'ms':>15} {'reference':>26} {'ref ms':>15} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['what']:>20} {r['ms']:>7.1f} ± {r['ms_stdev']:<5.1f} {r['reference']:>26} "
            f"{r['reference_ms']:>7.1f} ± {r['reference_ms_stdev']:<5.1f} {r['ratio']:>5.2f}x {r['verdict']} "
            f"(<= {SPEED_LIMIT}x)"
        )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    grads = real_gradients(args.model, args.batch, device)
    numel = sum(g.numel() for _, g in grads)
    print(f"{args.model}: {len(grads)} gradient tensors, {numel:,} fp32 values = {4 * numel:,} bytes dense")
    rows, fns = measure_all(args, grads)
    fns.update(reducer_fns(args.model, grads))
    timings = time_interleaved(fns, args.repeats, args.warmup, device)
    print(
        f"{'method':>10} {'gran.':>9} {'payload B':>12} {'exchange B':>12} {'vs fp32':>9} {'/theory':>8} "
        f"{'density':>8} {'enc+dec ms':>18}"
    )
    for row in rows:
        row["timing"] = timings[f"{row['method']}/{row['granularity']}"]
        print_row(row)
    print(
        f"timer scope: encode+decode of one step's units on one process, {args.repeats} interleaved repeats "
        f"(mean ± stdev), {args.warmup} warm-up excluded, {args.threads} torch thread(s); "
        f"'exchange B' = bytes handed to collectives (adds Threshold-v's size exchange)"
    )
    failed = [r for r in rows if r["verdict"].startswith("FAIL")]
    print(f"byte targets: {len([r for r in rows if r['verdict']]) - len(failed)} pass, {len(failed)} fail")
    speed = speed_rows(rows, timings)
    print_speed(speed)
    slow = [r for r in speed if r["verdict"] == "FAIL"]
    print(f"speed targets: {len(speed) - len(slow)} pass, {len(slow)} fail (ratio = median of paired repeats)")
    save_result(
        Path(args.out), {"config": vars(args), "environment": environment(device), "results": rows, "speed": speed}
    )
    print(f"saved {args.out}")


if __name__ == "__main__":
    run_script(main)
