"""Muon batched over filters: one Newton-Schulz iteration for many matrices at once.

``torch.optim.Muon`` orthogonalises each parameter's update on its own, eagerly: on a GPU that is ~10 kernel
launches per filter per step, and the launches, not the arithmetic, set the step time of a small net
(airbench's optimizer step was half its host time). Here the filters' updates are stacked into 3-D tensors and
the iteration runs as batched matrix products (``torch.baddbmm``), optionally compiled.

The update is torch.optim.Muon's, step for step: the momentum buffer lerps toward the gradient, the Nesterov
update lerps the gradient toward the buffer, the iteration (coefficients, ``eps``, in bf16 where the device computes
it natively, in fp32 elsewhere: ``iteration_dtype``) runs on the
wide orientation of each matrix (a tall one is transposed, as torch does), and the step is scaled by
sqrt(max(1, rows / cols)) ("original"). Two ways to stack:

- ``shape``: one batch per (oriented) shape: the arithmetic of the per-parameter iteration, no more;
- ``pad``: every matrix zero-padded to the largest rows x cols, one batch in all: fewest launches (the GPU's
  choice), more arithmetic. Zero rows and columns stay zero through the iteration (every term is a product with
  the padded matrix on one side), and the norm is unchanged, so the result is the same up to rounding.

The learning rate may be a float or a 0-dim tensor on the device (a compiled or graph-captured step needs the
tensor: a float would be baked in); nothing here reads the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainscale.train.precision import native_bf16

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
EPS = 1e-7
STACKING = ("shape", "pad")


def newton_schulz(x: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16, eps: float = EPS) -> Tensor:
    """The approximate orthogonalisation of each matrix of the batch ``x`` (B, rows, cols), rows <= cols, in
    ``dtype``: torch.optim.Muon's iteration with its batch dimension."""
    a, b, c = NS_COEFFICIENTS
    x = x.to(dtype)
    norms = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    x = x / norms.clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x


@dataclass
class Bucket:
    """Matrices iterated as one batch: their indices in the parameter list, whether each is transposed (tall),
    and the (rows, cols) every one is padded to."""

    members: list[int]
    transposed: list[bool]
    shape: tuple[int, int]


def iteration_dtype(device: torch.device) -> torch.dtype:
    """The Newton-Schulz iteration's dtype on ``device``: bf16 as torch.optim.Muon's where the device computes bf16
    natively (a GPU, a CPU with AVX-512 bf16), fp32 elsewhere, where bf16 products are emulated: airbench94's
    filters took 4.4 s a step in bf16 against 0.1 s in fp32 on a 2-core AVX2 CPU. fp32 only rounds less."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def plan_buckets(shapes: Sequence[tuple[int, int]], stacking: str) -> list[Bucket]:
    """How to stack matrices of ``shapes``: by oriented shape, or all padded into one (see module docstring)."""
    if stacking not in STACKING:
        raise ValueError(f"stacking must be one of {', '.join(STACKING)}, got {stacking!r}")
    oriented = [(min(r, c), max(r, c)) for r, c in shapes]
    keys = [s if stacking == "shape" else (0, 0) for s in oriented]
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(keys):
        buckets.setdefault(key, []).append(i)
    return [
        Bucket(
            members,
            [shapes[i][0] > shapes[i][1] for i in members],
            (max(oriented[i][0] for i in members), max(oriented[i][1] for i in members)),
        )
        for members in buckets.values()
    ]


def stack(mats: Sequence[Tensor], bucket: Bucket) -> Tensor:
    """The bucket's matrices in their wide orientation, zero-padded to the bucket's shape, as one 3-D tensor."""
    rows, cols = bucket.shape
    out = []
    for i, t in zip(bucket.members, bucket.transposed):
        m = mats[i].mT if t else mats[i]
        if m.shape != (rows, cols):
            m = torch.nn.functional.pad(m, (0, cols - m.shape[1], 0, rows - m.shape[0]))
        out.append(m)
    return torch.stack(out)


def orthogonalise(
    mats: Sequence[Tensor],
    buckets: Sequence[Bucket],
    ns: Callable[[Tensor], Tensor],
) -> list[Tensor]:
    """Each matrix's orthogonalised update (in its own shape, the iteration's dtype) through ``ns`` per bucket."""
    out: list[Tensor] = [mats[0]] * len(mats)
    for bucket in buckets:
        result = ns(stack(mats, bucket))
        for k, (i, t) in enumerate(zip(bucket.members, bucket.transposed)):
            r, c = mats[i].shape
            out[i] = result[k, :c, :r].mT if t else result[k, :r, :c]
    return out


def lr_ratio(shape: tuple[int, int]) -> float:
    """torch.optim.Muon's "original" scaling: sqrt(max(1, rows / cols))."""
    return math.sqrt(max(1.0, shape[0] / shape[1]))


class BatchedMuon:
    """Muon's update for a fixed list of 2-D parameters (views allowed), their buckets planned once.

    ``compile``: run each bucket's iteration through ``torch.compile`` (one graph per bucket shape);
    ``ns_dtype``: the iteration's dtype (bf16 as torch's; fp32 for an exact comparison)."""

    def __init__(
        self,
        shapes: Sequence[tuple[int, ...]],
        ns_steps: int,
        stacking: str = "shape",
        compile: bool = False,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.shapes = [(int(s[0]), int(s[1])) for s in shapes]
        self.buckets = plan_buckets(self.shapes, stacking)
        self.ratios = [lr_ratio(s) for s in self.shapes]
        self.compiled, self.ns_dtype = compile, ns_dtype

        def ns(x: Tensor) -> Tensor:
            return newton_schulz(x, ns_steps, ns_dtype)

        self.ns: Callable[[Tensor], Tensor] = torch.compile(ns, dynamic=False) if compile else ns

    @torch.no_grad()
    def step(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        buffers: Sequence[Tensor],
        lr: float | Tensor,
        momentum: float,
        nesterov: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        """One Muon step, in place on ``params`` and ``buffers`` (all 2-D, in the planned shapes)."""
        torch._foreach_lerp_(list(buffers), list(grads), 1 - momentum)
        updates = torch._foreach_lerp(list(grads), list(buffers), momentum) if nesterov else list(buffers)
        ortho = orthogonalise(updates, self.buckets, self.ns)
        if weight_decay:
            torch._foreach_mul_(list(params), 1 - lr * weight_decay)
        scaled = [o.to(p.dtype) * (lr * -ratio) for o, p, ratio in zip(ortho, params, self.ratios)]
        torch._foreach_add_(list(params), scaled)


MUON_COMPILE = ("auto", "on", "off")


def muon_plan(setting: str, device: torch.device) -> tuple[str, bool]:
    """(stacking, compiled) for ``--muon-compile`` on ``device``. ``auto``: on a GPU every filter padded into one
    compiled batch (launches are the cost there); on a CPU one eager batch per shape, since compiling needs a C++
    toolchain and its one-off cost falls in the first training step. ``on`` compiles anywhere (padded into one
    batch on a GPU, per shape on a CPU unless measured otherwise: see docs/speed-record.md)."""
    gpu = device.type == "cuda"
    return ("pad" if gpu else "shape"), setting == "on" or (setting == "auto" and gpu)
