"""2x2 max pooling (stride 2) for channels_last maps on a GPU, as two Triton kernels that torch.compile keeps in
its graphs: forward, each window's maximum and which of its four elements held it (one byte); backward, every
input element's gradient in one pass, in the input's memory order.

Why: torch.compile lowers ``max_pool2d``'s backward to a gather through stored indices, which on an H200 took
0.38 ms a step for the first airbench group's 189 MB map alone, where reading and writing that many bytes takes
a few tens of microseconds; the pooling of the three groups was 0.8 ms of a 4.8 ms step. Output and gradient are
``max_pool2d``'s: the first maximum of a window in its row-major order takes the gradient, a NaN counts as the
maximum, a trailing odd row and column get none.

Only on CUDA under torch.compile (``MaxPool2x2``); run eagerly or on a CPU it is ``F.max_pool2d``. Triton is
imported when first used: CPU builds of torch have none. The kernels come as ``triton_op``s, which torch.compile
traces into (``pool="triton"``), or as opaque custom ops it calls as they are (``pool="triton-opaque"``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 1024


@functools.cache
def kernels() -> tuple[Any, Any]:
    """The forward and backward Triton kernels, defined on first use (CPU builds of torch have no Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(x, out, which, H, h, C: tl.constexpr, W: tl.constexpr, w: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # n * h + oh: one output row, w * C elements, in memory order
        n, oh = row // h, row % h
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = j < w * C
        ow, c = j // C, j % C  # divisions by constants: shifts and multiplies
        src = x + (n * H + 2 * oh).to(tl.int64) * (W * C) + 2 * ow * C + c
        best = tl.load(src, mask=live).to(tl.float32)
        arg = tl.zeros([BLOCK], dtype=tl.int8)
        v = tl.load(src + C, mask=live).to(tl.float32)
        better = (v > best) | ((v != v) & (best == best))  # a NaN is the maximum
        best, arg = tl.where(better, v, best), tl.where(better, 1, arg).to(tl.int8)
        v = tl.load(src + W * C, mask=live).to(tl.float32)
        better = (v > best) | ((v != v) & (best == best))
        best, arg = tl.where(better, v, best), tl.where(better, 2, arg).to(tl.int8)
        v = tl.load(src + W * C + C, mask=live).to(tl.float32)
        better = (v > best) | ((v != v) & (best == best))
        best, arg = tl.where(better, v, best), tl.where(better, 3, arg).to(tl.int8)
        dst = row.to(tl.int64) * (w * C) + j
        tl.store(out + dst, best.to(out.dtype.element_ty), mask=live)  # exact: a value of x
        tl.store(which + dst, arg, mask=live)

    @triton.jit
    def backward_kernel(
        grad, which, grad_in, H, h, C: tl.constexpr, W: tl.constexpr, w: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)  # n * H + ih: one input row, W * C elements, in memory order
        n, ih = row // H, row % H
        oh = ih // 2
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = j < W * C
        iw, c = j // C, j % C
        ow = iw // 2
        inside = live & (ow < w) & (tl.full([BLOCK], 0, tl.int32) + oh < h)  # the row's test, as a block
        o = (n * h + oh).to(tl.int64) * (w * C) + ow * C + c
        g = tl.load(grad + o, mask=inside, other=0.0)
        arg = tl.load(which + o, mask=inside, other=-1)
        mine = (ih % 2) * 2 + iw % 2
        tl.store(grad_in + row.to(tl.int64) * (W * C) + j, tl.where(inside & (arg == mine), g, 0.0), mask=live)

    return forward_kernel, backward_kernel


def grid(rows: int, row: int) -> tuple[int, int]:
    """A program per row of the maps (``rows`` of them), and per ``BLOCK`` elements of a row of ``row``."""
    return rows, -(-row // BLOCK)


def _channels_last(like: torch.Tensor, n: int, c: int, h: int, w: int) -> torch.Tensor:
    """An uninitialised NCHW tensor laid out channels-last: allocated NHWC and viewed, since inductor lowers
    ``torch.empty(..., memory_format=channels_last)`` to a kernel that fills the buffer first (with NaN, a whole
    pass over it) where a plain allocation needs none."""
    return torch.empty((n, h, w, c), device=like.device, dtype=like.dtype).permute(0, 3, 1, 2)


def _outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = _channels_last(x, x.shape[0], x.shape[1], x.shape[2] // 2, x.shape[3] // 2)
    return out, torch.empty_like(out, dtype=torch.int8)


def _grad_in(grad: torch.Tensor, H: int, W: int) -> torch.Tensor:
    return _channels_last(grad, grad.shape[0], grad.shape[1], H, W)


def _pool(x: torch.Tensor, kernel: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward: ``x`` in channels_last, pooled by ``kernel`` (the forward kernel as the op launches it: wrapped
    for tracing, or as it is) into its maxima and which element held each."""
    x = x.contiguous(memory_format=torch.channels_last)
    n, c, H, W = x.shape
    out, which = _outputs(x)
    kernel[grid(n * (H // 2), (W // 2) * c)](x, out, which, H, H // 2, c, W, W // 2, BLOCK=BLOCK)
    return out, which


def _unpool(grad: torch.Tensor, which: torch.Tensor, H: int, W: int, kernel: Any) -> torch.Tensor:
    """The backward: the input's gradient (``H`` x ``W``) from the output's and ``which``, by ``kernel``."""
    grad = grad.contiguous(memory_format=torch.channels_last)
    n, c, h, w = grad.shape
    grad_in = _grad_in(grad, H, W)
    kernel[grid(n * H, W * c)](grad, which, grad_in, H, h, c, W, w, BLOCK=BLOCK)
    return grad_in


def _register_gradient(forward: Any, backward: Any) -> None:
    def save(ctx: Any, inputs: tuple[torch.Tensor], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ctx.save_for_backward(output[1])
        ctx.size = inputs[0].shape[-2:]

    def gradient(ctx: Any, grad: torch.Tensor, _which: torch.Tensor | None) -> torch.Tensor:
        (which,) = ctx.saved_tensors
        return backward(grad, which, *ctx.size)

    forward.register_autograd(gradient, setup_context=save)


@functools.cache
def ops() -> tuple[Any, Any]:
    """The forward and backward ops as ``triton_op``s: torch.compile traces into them and keeps the kernels in its
    graphs (``pool="triton"``)."""
    from torch.library import triton_op, wrap_triton

    forward_kernel, backward_kernel = kernels()

    @triton_op("trainscale::max_pool_2x2", mutates_args={})
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _pool(x, wrap_triton(forward_kernel))

    @triton_op("trainscale::max_pool_2x2_backward", mutates_args={})
    def backward(grad: torch.Tensor, which: torch.Tensor, H: int, W: int) -> torch.Tensor:
        return _unpool(grad, which, H, W, wrap_triton(backward_kernel))

    _register_gradient(forward, backward)
    return forward, backward


@functools.cache
def opaque_ops() -> tuple[Any, Any]:
    """The same kernels as opaque custom ops (``pool="triton-opaque"``): torch.compile calls them as they are
    rather than tracing into them, so nothing of what runs inside them is left to inductor's lowering (which,
    for one, filled ``torch.empty``'s channels-last buffers before the kernels wrote them: ``_channels_last``)."""
    from torch.library import custom_op

    forward_kernel, backward_kernel = kernels()

    @custom_op("trainscale::max_pool_2x2_opaque", mutates_args=())
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _pool(x, forward_kernel)

    @forward.register_fake
    def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _outputs(x)

    @custom_op("trainscale::max_pool_2x2_opaque_backward", mutates_args=())
    def backward(grad: torch.Tensor, which: torch.Tensor, H: int, W: int) -> torch.Tensor:
        return _unpool(grad, which, H, W, backward_kernel)

    @backward.register_fake
    def _(grad: torch.Tensor, which: torch.Tensor, H: int, W: int) -> torch.Tensor:
        return _grad_in(grad, H, W)

    _register_gradient(forward, backward)
    return forward, backward


def fused_available(opaque: bool = False) -> bool:
    """Whether the kernels can run here (a GPU and Triton); defines the ops on first call, which must come before
    torch.compile traces a call of them."""
    if not torch.cuda.is_available():
        return False
    try:
        opaque_ops() if opaque else ops()
    except ImportError:
        return False
    return True


def max_pool_2x2(x: torch.Tensor, opaque: bool = False) -> torch.Tensor:
    """``F.max_pool2d(x, 2)`` through the Triton kernels (a CUDA tensor; any layout, computed in channels_last);
    ``ops()`` (``opaque_ops()``) must have run."""
    op = torch.ops.trainscale.max_pool_2x2_opaque if opaque else torch.ops.trainscale.max_pool_2x2
    return op(x)[0]


class MaxPool2x2(nn.Module):
    """``nn.MaxPool2d(2)`` that takes the Triton kernels inside torch.compile on CUDA (see the module docstring);
    ``opaque``: as opaque custom ops (``opaque_ops``)."""

    def __init__(self, opaque: bool = False) -> None:
        super().__init__()
        self.opaque = opaque
        self.fused = fused_available(opaque)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_cuda and torch.compiler.is_compiling():
            return max_pool_2x2(x, self.opaque)
        return F.max_pool2d(x, 2)
