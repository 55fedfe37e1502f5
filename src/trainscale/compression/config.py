"""The compression section of the configuration (read into one ``spec.CompressionSpec``; its checks:
``setup.validate_compression``).

The cifar10-fast layer-wise compression study spells some settings differently, and both spellings work:
``--method topk`` for ``--compress topk``, ``--compress layerwise`` / ``entiremodel`` for
``--granularity``, and ``-K``/``-V``/``-Q`` for ``--ratio``, ``--threshold``, ``--qstates``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainscale.compression.exchange import DEFAULT_DENSE_BELOW
from trainscale.config import Section, option


@dataclass
class CompressionConfig(Section):
    TITLE: ClassVar[str] = "compressed communication (sync, localsgd, diloco; parameter-server pushes)"

    compress: str = option(
        "none",
        "none, fp16, bf16, randomk, topk, threshold, terngrad, qsgd, signsgd, "
        "efsignsgd, powersgd, dgc (or the layer-wise compression study's layerwise/entiremodel, "
        "meaning --granularity)",
    )
    method: str | None = option(
        None, "the compression method (the layer-wise compression study's name for --compress METHOD)"
    )
    granularity: str | None = option(None, "layerwise (each tensor on its own) or entire (all gradients as one vector)")
    ratio: float | None = option(None, "fraction of elements kept: randomk, topk, dgc", short="-K")
    threshold: float | None = option(None, "threshold: send every element with |g| >= V", short="-V")
    qstates: int | None = option(None, "qsgd: quantisation levels S", short="-Q")
    qsgd_bucket: int | None = option(
        None,
        "qsgd: elements that share one norm (default 0: one per tensor; the "
        "QSGD paper uses 512); fewer levels need smaller buckets",
    )
    powersgd_rank: int | None = option(None, "powersgd: rank r of the factors")
    error_feedback: bool = option(False, "keep what compression dropped and add it to the next step's gradient")
    compress_warmup_epochs: int = option(0, "train dense for the first E epochs, then compress")
    dense_below: int | None = option(
        None,
        f"layerwise randomk, topk, threshold: send tensors under N elements and 1-D tensors (biases, "
        f"normalisation) dense, counted as sent (default {DEFAULT_DENSE_BELOW}; 0: compress every tensor)",
        at_least=0,
    )
