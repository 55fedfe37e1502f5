"""Batch augmentations on NCHW tensors (uint8 or float), vectorised over the batch.

Every random choice comes from an explicit ``torch.Generator``; the per-image parameters (crop
offsets, flip mask, cutout centres, brightness and contrast factors) are drawn on the generator's device and then
moved to the data's device, so a CPU generator gives the same augmentation whether the data sit on the CPU or a GPU.
There is no per-sample Python loop: crops index a strided window view once, flips copy only the
selected images, cutout writes only the zeroed squares.

Each ``random_*`` function is a ``*_params`` draw followed by an ``apply_*`` step, so a caller (the
loader) can draw the parameters of a whole epoch once and apply them chunk by chunk with results
that do not depend on the chunk size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from trainscale.errors import ConfigError

PAD_MODES = ("reflect", "zero")


def _check_nchw(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what} expects an N,C,H,W batch, got shape {tuple(x.shape)}")


# --------------------------------------------------------------------------------------------- crop


def pad(x: torch.Tensor, padding: int, mode: str = "reflect") -> torch.Tensor:
    """Pad H and W by ``padding`` on every side; ``mode`` is "reflect" (mirror without repeating the edge
    pixel, as numpy's ``mode="reflect"``) or "zero"."""
    if padding == 0:
        return x
    if mode == "zero":
        return F.pad(x, (padding,) * 4, mode="constant", value=0)
    if mode == "reflect":
        if padding >= min(x.shape[-2:]):
            raise ConfigError(
                f"reflect padding {padding} needs images larger than {padding} pixels, "
                f"got {tuple(x.shape[-2:])}; use a smaller --crop-padding"
            )
        return F.pad(x, (padding,) * 4, mode="reflect")
    raise ConfigError(f"unknown pad mode '{mode}'; choose one of: {', '.join(PAD_MODES)}")


def crop_params(
    n: int, height: int, width: int, size: int, padding: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top/left offsets (int64, on ``gen``'s device) of ``n`` random ``size`` crops of padded images."""
    span_h = height + 2 * padding - size + 1
    span_w = width + 2 * padding - size + 1
    if span_h < 1 or span_w < 1:
        raise ConfigError(
            f"crop size {size} is larger than the {height}x{width} images padded by {padding}; "
            f"use a crop size of at most {min(height, width) + 2 * padding}"
        )
    oy = torch.randint(0, span_h, (n,), generator=gen, device=gen.device)
    ox = torch.randint(0, span_w, (n,), generator=gen, device=gen.device)
    return oy, ox


def crop_windows(
    padded: torch.Tensor, indices: torch.Tensor | None, size: int, oy: torch.Tensor, ox: torch.Tensor
) -> torch.Tensor:
    """``size`` x ``size`` crops at (``oy[k]``, ``ox[k]``) of the already padded images ``padded[indices[k]]``.

    One advanced-indexing gather through a strided window view: it selects the images and crops them
    in the same pass (``indices=None`` means all images in order).
    """
    _check_nchw(padded, "crop")
    n = padded.shape[0] if indices is None else indices.shape[0]
    rows = torch.arange(n, device=padded.device) if indices is None else indices.to(padded.device)
    # windows[n, c, i, j] is the size x size window of image n whose top-left corner is (i, j).
    windows = padded.unfold(2, size, 1).unfold(3, size, 1)
    return windows[rows, :, oy.to(padded.device), ox.to(padded.device)]  # (n, c, size, size), fresh


def apply_crop(
    x: torch.Tensor, size: int, padding: int, oy: torch.Tensor, ox: torch.Tensor, pad_mode: str = "reflect"
) -> torch.Tensor:
    """Crop image ``i`` of the padded batch at (``oy[i]``, ``ox[i]``); always returns a fresh tensor."""
    _check_nchw(x, "crop")
    xp = pad(x, padding, pad_mode)
    hp, wp = xp.shape[-2:]
    if hp == size and wp == size:  # only one possible window: the (padded) input itself
        return xp if padding else x.clone()
    return crop_windows(xp, None, size, oy, ox)


def random_crop(
    x: torch.Tensor, size: int, padding: int = 0, *, gen: torch.Generator, pad_mode: str = "reflect"
) -> torch.Tensor:
    """Pad every side by ``padding`` then take a random ``size`` x ``size`` window per image.

    The cifar10-fast recipe is ``padding=4, size=32`` with reflect padding (its ``pad`` helper uses
    numpy's reflect mode), which is the default here; ``pad_mode="zero"`` gives the torchvision-style
    zero padding. The MXNet recipe of random 28x28 crops of 32x32 images is ``size=28, padding=0``.
    """
    _check_nchw(x, "random_crop")
    n, _, h, w = x.shape
    oy, ox = crop_params(n, h, w, size, padding, gen)
    return apply_crop(x, size, padding, oy, ox, pad_mode)


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The central ``size`` x ``size`` window of every image (a view; extra pixel goes bottom/right)."""
    _check_nchw(x, "center_crop")
    h, w = x.shape[-2:]
    if size > h or size > w:
        raise ConfigError(f"center crop size {size} is larger than the {h}x{w} images")
    top, left = (h - size) // 2, (w - size) // 2
    return x[:, :, top : top + size, left : left + size]


# --------------------------------------------------------------------------------------------- flip


def flip_mask(n: int, gen: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Bool mask (on ``gen``'s device) of the images to flip, each independently with probability p."""
    return torch.rand(n, generator=gen, device=gen.device) < p


def apply_flip(x: torch.Tensor, mask: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """Mirror (left-right) the images where ``mask`` is True; only those images are copied."""
    _check_nchw(x, "flip")
    out = x if inplace else x.clone()
    selected = mask.to(x.device).nonzero().squeeze(1)
    if selected.numel():
        out.index_copy_(0, selected, out.index_select(0, selected).flip(3))
    return out


def random_flip(x: torch.Tensor, gen: torch.Generator, *, p: float = 0.5, inplace: bool = False) -> torch.Tensor:
    """Horizontal flip of each image with probability ``p`` (the mask is ``flip_mask(len(x), gen, p)``)."""
    return apply_flip(x, flip_mask(x.shape[0], gen, p), inplace=inplace)


# ------------------------------------------------------------------------------------------- cutout


def cutout_params(n: int, height: int, width: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Square centres (row, col), uniform over the image, on ``gen``'s device."""
    cy = torch.randint(0, height, (n,), generator=gen, device=gen.device)
    cx = torch.randint(0, width, (n,), generator=gen, device=gen.device)
    return cy, cx


def apply_cutout(
    x: torch.Tensor, size: int, cy: torch.Tensor, cx: torch.Tensor, *, inplace: bool = False
) -> torch.Tensor:
    """Zero, in every channel, the ``size`` x ``size`` square of image i centred on (cy[i], cx[i]).

    The square spans rows ``cy - size//2 .. cy - size//2 + size - 1`` (likewise columns), clipped at
    the borders. Only the squares are written: indices outside the image are clamped onto the border
    row/column, which lies inside the clipped square anyway.
    """
    _check_nchw(x, "cutout")
    out = x if inplace else x.clone()
    if size <= 0 or x.shape[0] == 0:
        return out
    n, _, h, w = x.shape
    offsets = torch.arange(size, device=x.device) - size // 2
    rows = (cy.to(x.device)[:, None] + offsets).clamp_(0, h - 1)  # (n, size)
    cols = (cx.to(x.device)[:, None] + offsets).clamp_(0, w - 1)
    images = torch.arange(n, device=x.device)[:, None, None]
    out[images, :, rows[:, :, None], cols[:, None, :]] = 0
    return out


def cutout(x: torch.Tensor, size: int = 8, *, gen: torch.Generator, inplace: bool = False) -> torch.Tensor:
    """Cutout (DeVries & Taylor 2017): zero a ``size`` x ``size`` square at a random centre per image,
    clipped at the borders (so squares near an edge zero fewer pixels)."""
    _check_nchw(x, "cutout")
    n, _, h, w = x.shape
    cy, cx = cutout_params(n, h, w, gen)
    return apply_cutout(x, size, cy, cx, inplace=inplace)


# ------------------------------------------------------------------------------ brightness and contrast


def brightness_contrast_params(
    n: int, brightness: float, contrast: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image factors, uniform in [1 - brightness, 1 + brightness] and [1 - contrast, 1 + contrast] (float32,
    on ``gen``'s device); a strength of 0 gives factors of exactly 1 and draws nothing."""
    factors = []
    for strength in (brightness, contrast):
        if strength:
            u = torch.rand(n, generator=gen, device=gen.device, dtype=torch.float32)
            factors.append(1.0 + strength * (2.0 * u - 1.0))
        else:
            factors.append(torch.ones(n, device=gen.device, dtype=torch.float32))
    return factors[0], factors[1]


def apply_brightness_contrast(x: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor) -> torch.Tensor:
    """Float images in 0..1: brightness scales every pixel of image i by ``brightness[i]``; contrast then scales
    its pixels' distance from the image's mean (over channels and pixels) by ``contrast[i]``; the result is
    clipped to 0..1. A new float32 tensor; the input is not modified."""
    _check_nchw(x, "brightness/contrast")
    b = brightness.to(x.device, torch.float32).view(-1, 1, 1, 1)
    c = contrast.to(x.device, torch.float32).view(-1, 1, 1, 1)
    out = x.to(torch.float32) * b
    mean = out.mean(dim=(1, 2, 3), keepdim=True)
    return out.sub_(mean).mul_(c).add_(mean).clamp_(0.0, 1.0)


# ----------------------------------------------------------------------------- normalise and resize


@functools.lru_cache(maxsize=64)
def _affine(
    mean: tuple[float, ...], std: tuple[float, ...], unit: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, shift) with ``x * scale - shift == (x / unit - mean) / std``, cached per device."""
    mean_t = torch.tensor(mean, dtype=torch.float64)
    std_t = torch.tensor(std, dtype=torch.float64)
    scale = (1.0 / (unit * std_t)).to(torch.float32).view(1, -1, 1, 1)
    shift = (mean_t / std_t).to(torch.float32).view(1, -1, 1, 1)
    return scale.to(device), shift.to(device)


def normalize(
    x: torch.Tensor, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(x/255 - mean) / std`` per channel for uint8 input (float input is taken to be in 0..1 already).

    Computed in float32 into a new tensor and cast to ``dtype`` at the end (so bf16/fp16 output loses
    nothing extra); the input is never modified.
    """
    _check_nchw(x, "normalize")
    channels = x.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"normalize: {channels} channels but {len(mean)} means and {len(std)} stds")
    unit = 255.0 if x.dtype == torch.uint8 else 1.0
    scale, shift = _affine(tuple(float(m) for m in mean), tuple(float(s) for s in std), unit, x.device)
    out = x.to(torch.float32, copy=True)  # a new tensor even for float32 input
    out.mul_(scale).sub_(shift)
    return out if dtype == torch.float32 else out.to(dtype)


def resize(x: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of every image to ``size`` (e.g. CIFAR 32 -> 299 for Inception-v3).

    Float input stays float; uint8 input is resized in float32 and rounded back to uint8.
    """
    _check_nchw(x, "resize")
    target = (size, size) if isinstance(size, int) else tuple(size)
    if tuple(x.shape[-2:]) == target:
        return x
    if x.dtype == torch.uint8:
        out = F.interpolate(x.to(torch.float32), size=target, mode="bilinear", align_corners=False)
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return F.interpolate(x, size=target, mode="bilinear", align_corners=False)
