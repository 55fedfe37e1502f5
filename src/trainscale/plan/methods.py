"""``--compress`` specs of the planner: ``METHOD[:key=value,...]``, e.g. ``topk:ratio=0.01,granularity=entire``.

A profile measures several compressors at once and a plan names one of them, so each is a single string:
the compression package's one description (``CompressionSpec``) in its text form, whose canonical text
(sorted keys, the method's registry name, no seed) is the key under which a profile stores it.
"""

from __future__ import annotations

from trainscale.compression.spec import DENSE, CompressionSpec

MethodSpec = CompressionSpec  # the planner's name for it

__all__ = ["DENSE", "MethodSpec", "parse_spec"]


def parse_spec(text: str) -> CompressionSpec:
    """``topk:ratio=0.01`` -> the spec; a bad method, key or value is a one-line ConfigError."""
    return CompressionSpec.parse(text)
