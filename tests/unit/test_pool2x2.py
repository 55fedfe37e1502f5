"""``models.pool2x2``: the Triton 2x2 max pooling gives ``max_pool2d``'s output and gradient exactly (ties, odd
sizes, channel counts that are no power of two, bf16), run by Triton's interpreter on the CPU where Triton is
installed and compiled on a GPU; without a GPU the module is ``max_pool2d``; ``--model-arg pool`` picks it."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainscale.errors import ConfigError
from trainscale.models import create_model
from trainscale.models.airbench import ConvGroup
from trainscale.models.pool2x2 import MaxPool2x2

SHAPES = [(3, 8, 31, 31), (2, 300, 5, 5), (2, 4, 8, 8), (1, 1, 2, 3)]


def maps_with_ties(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Random NCHW maps laid out channels_last, every 7th element a copy of its neighbour (ties in windows)."""
    n, c, h, w = shape
    x = torch.randn(n, h, w, c, dtype=dtype, device=device)
    flat = x.view(-1)
    k = min(flat[::7].numel(), flat[1::7].numel())
    flat[: 7 * k : 7] = flat[1 : 7 * k : 7]
    return x.permute(0, 3, 1, 2)


CHECK = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from tests.unit.test_pool2x2 import SHAPES, maps_with_ties
    from trainscale.models.pool2x2 import ops, opaque_ops
    torch.manual_seed(0)
    for forward in (ops()[0], opaque_ops()[0]):
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                x = maps_with_ties(shape, dtype)
                a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
                want, (got, _) = F.max_pool2d(a, 2), forward(b)
                g = torch.randn_like(want)
                want.backward(g)
                got.backward(g)
                assert torch.equal(want, got) and torch.equal(a.grad, b.grad), (dtype, shape)
                assert b.grad.is_contiguous(memory_format=torch.channels_last)
    print("exact")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU builds of torch)")
def test_the_kernels_give_max_pool2ds_output_and_gradient_exactly_under_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "exact" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("opaque", [False, True])
@pytest.mark.parametrize("shape", [(1536, 64, 31, 31), (1536, 256, 15, 15), (256, 300, 7, 7)])
def test_compiled_on_a_gpu_the_pooling_is_max_pool2ds_exactly(shape: tuple[int, ...], opaque: bool) -> None:
    """speedrun94's first two groups' maps at its batch, and an odd channel count; the kernels traced into the
    graph and called as opaque ops. The buffers they write are allocated, never filled first (inductor's
    ``fused_empty`` kernels)."""
    from torch._inductor.utils import run_and_get_code

    pool = MaxPool2x2(opaque)
    assert pool.fused
    compiled = torch.compile(lambda t: pool(t) * 1.0, dynamic=False)
    x = maps_with_ties(shape, torch.bfloat16, "cuda")
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = F.max_pool2d(a, 2)
    g = torch.randn_like(want)
    want.backward(g)

    def forward_backward() -> torch.Tensor:
        got = compiled(b)
        got.backward(g)
        return got

    got, code = run_and_get_code(forward_backward)
    assert torch.equal(want, got)
    assert torch.equal(a.grad, b.grad)
    assert code and not [c for c in code if "fused_empty" in c]


def test_without_a_gpu_the_module_is_max_pool2d_and_trains_the_same() -> None:
    torch.manual_seed(0)
    x = maps_with_ties((2, 6, 9, 9), torch.float32)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = F.max_pool2d(a, 2), torch.compile(MaxPool2x2(), backend="aot_eager")(b)
    want.sum().backward()
    got.sum().backward()
    assert torch.equal(want, got) and torch.equal(a.grad, b.grad)


def test_the_model_argument_picks_the_pooling_and_a_wrong_one_is_one_line() -> None:
    for model in (create_model("speedrun94"), create_model("airbench94", pool="triton")):  # speedrun94's default
        assert all(isinstance(group, ConvGroup) and isinstance(group.pool, MaxPool2x2) for group in model.groups)
    for model in (create_model("airbench94"), create_model("speedrun94", pool="max")):  # airbench94's default
        assert all(isinstance(group.pool, torch.nn.MaxPool2d) for group in model.groups)
    opaque = create_model("speedrun94", pool="triton-opaque")
    assert all(isinstance(group.pool, MaxPool2x2) and group.pool.opaque for group in opaque.groups)
    with pytest.raises(
        ConfigError, match=r"^--model-arg pool=avg: no such pooling; use one of max, triton, triton-opaque$"
    ):
        create_model("speedrun94", pool="avg")


@functools.cache
def corners_op() -> Any:
    """An op that writes into a buffer it is given, as the pooling kernels do (registered once a process)."""

    @torch.library.custom_op("trainscale_test::take_corners", mutates_args={"out"})
    def take_corners(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x[:, :, ::2, ::2])

    return take_corners


def test_inductor_allocates_the_kernels_outputs_without_filling_them() -> None:
    """``_channels_last``'s buffer is allocated and handed to the op that writes it; a channels-last
    ``torch.empty`` would be lowered to an allocation and a pass that fills it (on a GPU, the ``fused_empty``
    kernels). On the CPU's inductor: the only kernel generated is the one that reads the op's result."""
    from torch._inductor.utils import run_and_get_code

    from trainscale.models.pool2x2 import _channels_last

    take_corners = corners_op()

    def pooled(x: torch.Tensor) -> torch.Tensor:
        out = _channels_last(x, x.shape[0], x.shape[1], x.shape[2] // 2, x.shape[3] // 2)
        take_corners(x, out)
        return out * 2

    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    got, code = run_and_get_code(torch.compile(pooled, dynamic=False), x)
    assert torch.equal(got, 2 * x[:, :, ::2, ::2]) and got.is_contiguous(memory_format=torch.channels_last)
    assert len(code) == 1 and code[0].count("async_compile.cpp_pybinding(") == 1
