"""PowerSGD (Vogels et al. 2019): rank-r factors of each gradient matrix, both of them all-reducible.

Per step and matrix M (n x m, a parameter viewed as ``shape[0] x rest``): P = M Q, all-reduce P,
orthonormalise it, Q = M^T P, all-reduce Q, and use P Q^T / W. Q is warm-started from the previous
step (it starts from a shared-seed Gaussian, identical on every rank, so the summed P makes sense).
Tensors whose factors would not be smaller than themselves (biases, BN vectors) travel dense inside
the first all-reduce. The entire-model vector has no matrix shape, so it is folded into a near-square
matrix (zero-padded). Error feedback is part of the method: each rank keeps ``M - P (M^T P)^T``,
exactly what its own contribution lost.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from trainscale.compression.base import Compressor, Payload, UnitContext, register_compressor, stable_seed
from trainscale.compression.collectives import Communicator
from trainscale.errors import ConfigError


def matrix_shape(shape: tuple[int, ...], rank: int, min_square: int = 4096) -> tuple[int, int] | None:
    """The (n, m) view of a tensor for rank-``rank`` factors, or None when sending it dense is cheaper."""
    numel = math.prod(shape)
    if len(shape) >= 2:
        n, m = shape[0], numel // max(1, shape[0])
    elif numel >= min_square:
        n = math.isqrt(numel - 1) + 1
        m = math.ceil(numel / n)
    else:
        return None
    return (n, m) if (n + m) * rank < n * m else None


def as_matrix(x: Tensor, nm: tuple[int, int]) -> Tensor:
    flat = x.reshape(-1).float()
    pad = nm[0] * nm[1] - flat.numel()
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(nm)


def from_matrix(m: Tensor, like_shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return m.reshape(-1)[: math.prod(like_shape)].to(dtype).reshape(like_shape)


def orthonormalise(p: Tensor) -> Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR; a zero matrix gives unit vectors, never NaN)."""
    return torch.linalg.qr(p, mode="reduced").Q


@register_compressor
class PowerSGD(Compressor):
    name: ClassVar[str] = "powersgd"
    shared_state: ClassVar[bool] = True
    aggregation: ClassVar[str] = "custom"
    feedback: ClassVar[str] = "always"

    def __init__(self, rank: int = 2, min_square: int = 4096, seed: int = 0) -> None:
        super().__init__(seed)
        self.rank = int(rank)
        if self.rank < 1:
            raise ConfigError(f"PowerSGD rank must be >= 1, got {rank}")
        self.min_square = int(min_square)
        self._q: dict[str, Tensor] = {}

    def _warm_q(self, key: str, m: int, device: torch.device) -> Tensor:
        q = self._q.get(key)
        if q is None or q.shape != (m, self.rank) or q.device != device:
            gen = torch.Generator(device=device)
            gen.manual_seed(stable_seed(self.seed, "powersgd-q", key))
            q = torch.randn(m, self.rank, generator=gen, device=device)
        return q

    # Single-worker form (a parameter server push, the tests, the benchmark): both factors locally.
    def encode(self, x: Tensor, ctx: UnitContext) -> Payload:
        nm = matrix_shape(tuple(x.shape), self.rank, self.min_square)
        if nm is None:
            return Payload({"values": x.reshape(-1)}, tuple(x.shape), x.dtype)
        mat = as_matrix(x, nm)
        p = orthonormalise(mat @ self._warm_q(ctx.key, nm[1], x.device))
        q = mat.t() @ p
        self._q[ctx.key] = q
        return Payload({"p": p.reshape(-1), "q": q.reshape(-1)}, tuple(x.shape), x.dtype, {"matrix": nm})

    def decode(self, payload: Payload) -> Tensor:
        if "values" in payload.tensors:
            return payload.tensors["values"].to(payload.dtype).reshape(payload.shape)
        n, m = payload.meta["matrix"]
        p = payload.tensors["p"].view(n, self.rank)
        q = payload.tensors["q"].view(m, self.rank)
        return from_matrix(p @ q.t(), payload.shape, payload.dtype)

    # Collective form: two all-reduces per step for all units together.
    def reduce(
        self, xs: list[Tensor], ctxs: list[UnitContext], comm: Communicator
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Averaged tensors and what each rank's own input contributed (for its residual)."""
        world, stats = comm.world_size, comm.stats
        plans = [matrix_shape(tuple(x.shape), self.rank, self.min_square) for x in xs]
        with stats.timer("encode"):
            mats = {i: as_matrix(x, nm) for i, (x, nm) in enumerate(zip(xs, plans)) if nm is not None}
            ps = {i: m @ self._warm_q(ctxs[i].key, m.shape[1], m.device) for i, m in mats.items()}
            dense = {i: x.reshape(-1).float().clone() for i, x in enumerate(xs) if plans[i] is None}
        comm.all_reduce_(list(ps.values()) + list(dense.values()))
        with stats.timer("encode"):
            ps = {i: orthonormalise(p) for i, p in ps.items()}
            local_q = {i: mats[i].t() @ p for i, p in ps.items()}
            summed_q = {i: q.clone() for i, q in local_q.items()}
        comm.all_reduce_(list(summed_q.values()))
        with stats.timer("decode"):
            return self._finish(xs, ctxs, ps, local_q, summed_q, dense, world)

    def _finish(
        self,
        xs: list[Tensor],
        ctxs: list[UnitContext],
        ps: dict[int, Tensor],
        local_q: dict[int, Tensor],
        summed_q: dict[int, Tensor],
        dense: dict[int, Tensor],
        world: int,
    ) -> tuple[list[Tensor], list[Tensor]]:
        out, sent = [], []
        for i, x in enumerate(xs):
            shape = tuple(x.shape)
            if i in dense:
                out.append(from_matrix(dense[i] / world, shape, x.dtype))
                sent.append(x)
                continue
            self._q[ctxs[i].key] = summed_q[i] / world
            out.append(from_matrix(ps[i] @ summed_q[i].t() / world, shape, x.dtype))
            sent.append(from_matrix(ps[i] @ local_q[i].t(), shape, x.dtype))
        return out, sent

    def theoretical_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> float:
        nm = matrix_shape(shape or (numel,), self.rank, self.min_square)
        return 4.0 * (nm[0] + nm[1]) * self.rank if nm else 4.0 * numel

    def state_dict(self) -> dict[str, Any]:
        return {"q": {k: v.clone() for k, v in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._q = {k: v.clone() for k, v in state.get("q", {}).items()}

    def describe(self) -> str:
        return f"powersgd(rank={self.rank})"
