"""Pack small unsigned integers into a dense byte stream, vectorised (no per-element Python).

Quantisers (TernGrad: 2 bits, signSGD: 1 bit, QSGD: ceil(log2(2S+1)) bits) are only as small on the
wire as their packing. A ``b``-bit code (1 <= b <= 16) is split into *planes* so every plane packs with
a few whole-tensor shifts: first whole bytes (bits 0-7, then 8-15 for b >= 8), then the remaining
``b mod 8`` bits as planes of width 4, 2 and 1 (e.g. 9 bits = one 8-bit plane + one 1-bit plane;
7 bits = 4 + 2 + 1). Each plane is stored densely, LSB first inside a byte (value ``j`` of a byte
holding ``8/w`` values sits at bits ``j*w .. j*w+w-1``), and the planes are concatenated lowest bits
first. The stream therefore takes ``sum(ceil(n * w / 8))`` bytes: exactly ``n * b / 8`` when ``n`` is
a multiple of 8, at most 3 bytes more otherwise.

One-bit planes of CPU tensors (signs, bitmaps) go through numpy's ``packbits``/``unpackbits``, which
write the same LSB-first bytes as the shifts below some hundred times faster; wider planes and CUDA
tensors use the shifts.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch
from torch import Tensor

MAX_BITS = 16


def planes(bits: int) -> list[tuple[int, int]]:
    """(bit offset, width) of each plane of a ``bits``-bit code, lowest bits first."""
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in 1..{MAX_BITS}, got {bits}")
    out, offset = [], 0
    for width in (8, 8, 4, 2, 1):
        if bits - offset >= width:
            out.append((offset, width))
            offset += width
    return out


def plane_nbytes(numel: int, width: int) -> int:
    return math.ceil(numel * width / 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``pack_bits`` produces for ``numel`` codes of ``bits`` bits."""
    return sum(plane_nbytes(numel, width) for _, width in planes(bits))


def bits_for(levels: int) -> int:
    """Fewest bits that hold the codes ``0 .. levels - 1``."""
    return max(1, math.ceil(math.log2(levels))) if levels > 1 else 1


def _pack_plane(values: Tensor, width: int) -> Tensor:
    """Pack uint8 values < 2**width; ``8 // width`` values per byte."""
    if width == 8:
        return values
    if width == 1 and values.device.type == "cpu":
        return torch.from_numpy(np.packbits(values.contiguous().numpy(), bitorder="little"))
    per = 8 // width
    pad = (-values.numel()) % per
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    cols = values.view(-1, per)
    out = cols[:, 0].clone()
    for j in range(1, per):
        out |= cols[:, j] << (j * width)
    return out


def _unpack_plane(packed: Tensor, width: int, numel: int) -> Tensor:
    if width == 8:
        return packed[:numel]
    if width == 1 and packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), count=numel, bitorder="little"))
    per, mask = 8 // width, (1 << width) - 1
    out = torch.empty(packed.numel(), per, dtype=torch.uint8, device=packed.device)
    for j in range(per):  # one whole-tensor op per value slot of a byte, not per element
        out[:, j] = (packed >> (j * width)) & mask
    return out.view(-1)[:numel]


def _byte_planes(codes: Tensor, bits: int) -> list[Tensor]:
    """The codes as 1 or 2 uint8 tensors: the low byte, then (for ``bits > 8``) the high byte."""
    if bits <= 8:
        return [codes if codes.dtype == torch.uint8 else codes.to(torch.uint8)]
    pairs = codes.to(torch.int16).view(torch.uint8).view(-1, 2)  # wraps 32768..65535 bit-exactly
    low, high = (0, 1) if sys.byteorder == "little" else (1, 0)
    return [pairs[:, low].contiguous(), pairs[:, high].contiguous()]


def _split(byte: Tensor, bits: int) -> list[Tensor]:
    """Split uint8 values < 2**bits into sub-planes of widths 4, 2, 1 (no work when ``bits`` is 1, 2, 4)."""
    if bits in (1, 2, 4, 8):
        return [byte]
    out, offset = [], 0
    for width in (4, 2, 1):
        if bits - offset >= width:
            out.append((byte >> offset) & ((1 << width) - 1))
            offset += width
    return out


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack non-negative integer ``codes`` (< 2**bits, any integer dtype) into a flat uint8 tensor."""
    plan = planes(bits)
    codes = codes.reshape(-1)
    byte_planes = _byte_planes(codes, bits)
    rest_bits = bits - 8 * (bits // 8)
    values = byte_planes[: bits // 8] + (_split(byte_planes[-1], rest_bits) if rest_bits else [])
    chunks = [_pack_plane(v, width) for v, (_, width) in zip(values, plan)]
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0].contiguous()


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of ``pack_bits``: ``numel`` codes, as uint8 when ``bits <= 8`` and int32 otherwise."""
    if packed.numel() != packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    bytes_: list[Tensor] = []
    rest: Tensor | None = None
    start = 0
    for offset, width in planes(bits):
        size = plane_nbytes(numel, width)
        plane = _unpack_plane(packed[start : start + size], width, numel)
        start += size
        if width == 8:
            bytes_.append(plane)
        else:
            shifted = plane << (offset % 8) if offset % 8 else plane
            rest = shifted if rest is None else rest | shifted
    if rest is not None:
        bytes_.append(rest)
    if bits <= 8:
        return bytes_[0]
    pair = torch.stack(bytes_ if sys.byteorder == "little" else bytes_[::-1], dim=1)
    wide = pair.view(torch.int16).view(-1).to(torch.int32)
    return wide & 0xFFFF if bits == 16 else wide
