"""Batched Muon (train.muon) against the per-parameter Muon it replaces: torch.optim.Muon's update on each filter
alone. In fp32 the two must agree to 1e-5 over several steps of momentum and Nesterov, for conv filters of
several aspect ratios (wide, square, tall), plain matrices and transposed views, stacked by shape or padded into
one batch; compiled must equal eager; the optimizer of ``--optimizer muon`` must match torch.optim.Muon itself."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from trainscale.config import CoreConfig
from trainscale.train import muon as muon_module
from trainscale.train.muon import NS_COEFFICIENTS, BatchedMuon, muon_plan, plan_buckets
from trainscale.train.optimizers import MUON_NS_STEPS, MuonWithSGD, build_optimizer, matrix

SHAPES_4D = [(8, 3, 3, 3), (16, 8, 3, 3), (16, 16, 3, 3), (64, 2, 1, 1), (16, 16, 3, 3)]
SHAPES_2D = [(10, 40), (40, 10), (12, 12)]


def per_parameter_muon(
    param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float, momentum: float, nesterov: bool
) -> None:
    """torch.optim.Muon's single-tensor update, with the iteration in fp32 instead of bf16 (the reference)."""
    a, b, c = NS_COEFFICIENTS
    buf.lerp_(grad, 1 - momentum)
    x = (grad.lerp(buf, momentum) if nesterov else buf).clone()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(MUON_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.T if tall else x
    param.add_(x, alpha=-lr * math.sqrt(max(1, param.shape[0] / param.shape[1])))


def matrices(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    filters = [torch.randn(s, generator=g).reshape(s[0], -1) for s in SHAPES_4D]
    plain = [torch.randn(s, generator=g) for s in SHAPES_2D]
    transposed = [torch.randn(24, 6, generator=g).T]  # a (6, 24) view with column-major strides
    return filters + plain + transposed


@pytest.mark.parametrize("stacking", ["shape", "pad"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_equals_per_parameter_muon_in_fp32(stacking: str, nesterov: bool) -> None:
    ours, ref = matrices(0), [m.clone() for m in matrices(0)]
    buf_ours = [torch.zeros_like(m) for m in ours]
    buf_ref = [torch.zeros_like(m) for m in ref]
    muon = BatchedMuon([tuple(m.shape) for m in ours], MUON_NS_STEPS, stacking=stacking, ns_dtype=torch.float32)
    for step in range(4):
        grads = matrices(100 + step)
        lr = 0.1 * (1 - step / 8)
        muon.step(ours, grads, buf_ours, lr, momentum=0.6, nesterov=nesterov)
        for p, gr, b in zip(ref, grads, buf_ref):
            per_parameter_muon(p, gr, b, lr, 0.6, nesterov)
    for a, b in zip(ours + buf_ours, ref + buf_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours[0], matrices(0)[0])  # it did move


def test_padding_packs_every_shape_into_one_batch_and_shape_stacking_groups_equal_shapes() -> None:
    shapes = [tuple(m.shape) for m in matrices(0)]
    assert len(plan_buckets(shapes, "pad")) == 1
    by_shape = plan_buckets(shapes, "shape")
    assert len(by_shape) == len(shapes) - 2  # (16, 144) twice; (10, 40) and (40, 10) alike once oriented
    assert [b.transposed for b in by_shape if b.shape == (10, 40)] == [[False, True]]
    assert {b.shape for b in by_shape} == {(min(r, c), max(r, c)) for r, c in shapes}
    with pytest.raises(ValueError, match="stacking must be one of"):
        plan_buckets(shapes, "bogus")


def test_a_tensor_learning_rate_gives_the_float_ones_update() -> None:
    a, b = matrices(0), matrices(0)
    bufs_a, bufs_b = [torch.zeros_like(m) for m in a], [torch.zeros_like(m) for m in b]
    muon = BatchedMuon([tuple(m.shape) for m in a], MUON_NS_STEPS, ns_dtype=torch.float32)
    muon.step(a, matrices(7), bufs_a, 0.05, momentum=0.9)
    muon.step(b, matrices(7), bufs_b, torch.tensor(0.05), momentum=0.9)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_compiled_equals_eager() -> None:
    eager, compiled = matrices(0), matrices(0)
    bufs_e, bufs_c = [torch.zeros_like(m) for m in eager], [torch.zeros_like(m) for m in compiled]
    shapes = [tuple(m.shape) for m in eager]
    e = BatchedMuon(shapes, MUON_NS_STEPS, stacking="pad", ns_dtype=torch.float32)
    c = BatchedMuon(shapes, MUON_NS_STEPS, stacking="pad", ns_dtype=torch.float32, compile=True)
    for step in range(3):
        e.step(eager, matrices(50 + step), bufs_e, 0.1, momentum=0.6)
        c.step(compiled, matrices(50 + step), bufs_c, 0.1, momentum=0.6)
    for x, y in zip(eager + bufs_e, compiled + bufs_c):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3)
        self.b = nn.Conv2d(8, 32, 3)
        self.c = nn.Conv2d(32, 8, 1)
        self.bn = nn.BatchNorm2d(8)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_optimizer_of_optimizer_muon_matches_torch_optim_muon(channels_last: bool) -> None:
    """The filters' group, bf16 iteration as torch's, filters normalised as airbench does, against
    torch.optim.Muon stepping each filter's matrix view alone (the per-parameter path this replaces). The same
    gradients go to both: bf16 Muon amplifies a 1e-8 difference in its input to 1e-2 within a step or two, so
    gradients from two forward passes would test that chaos, not the update."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    ours = Convs().to(memory_format=layout)
    ref = copy.deepcopy(ours)
    cfg = CoreConfig()
    cfg.optim.optimizer, cfg.optim.muon_lr, cfg.optim.muon_momentum = "muon", 0.05, 0.6
    opt = build_optimizer(cfg, ours, lr=0.1)
    assert isinstance(opt, MuonWithSGD) and opt.muon_plan == ("shape", False)
    opt.ns_dtype = torch.bfloat16  # torch's, also on a CPU whose own choice is fp32
    mine = [p for p in ours.parameters() if p.ndim == 4]
    filters = [p for p in ref.parameters() if p.ndim == 4]
    views = [nn.Parameter(matrix(p.detach(), p), requires_grad=False) for p in filters]
    torch_muon = [torch.optim.Muon([v], lr=0.05, momentum=0.6, weight_decay=0.0, ns_steps=MUON_NS_STEPS) for v in views]
    start = mine[0].detach().clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(mine, filters):
            p.grad = torch.randn(p.shape, generator=g).contiguous(memory_format=layout)
            q.grad = p.grad.clone()
        opt.step()
        with torch.no_grad():
            for p, v, m in zip(filters, views, torch_muon):
                p.mul_(math.sqrt(p.shape[0]) / p.norm().clamp_min(1e-12))
                v.grad = matrix(p.grad, p)
                m.step()
    for a, b in zip(mine, filters):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.equal(mine[0], start)


def test_auto_compiles_on_a_gpu_only_and_on_off_are_honoured() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert muon_plan("auto", cpu) == ("shape", False)
    assert muon_plan("auto", gpu) == ("pad", True)
    assert muon_plan("on", cpu) == ("shape", True)
    assert muon_plan("off", gpu) == ("pad", False)


@pytest.mark.parametrize("native", [True, False])
def test_the_iteration_runs_in_bf16_only_where_the_device_computes_it_natively(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 as torch's where the device has it; fp32 on a CPU that emulates bf16 (40x slower there)."""
    monkeypatch.setattr(muon_module, "native_bf16", lambda device: native)
    model = Convs()
    cfg = CoreConfig()
    cfg.optim.optimizer, cfg.optim.muon_lr, cfg.optim.muon_momentum = "muon", 0.05, 0.6
    opt = build_optimizer(cfg, model, lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert {m.ns_dtype for m in opt._muons.values()} == {torch.bfloat16 if native else torch.float32}
