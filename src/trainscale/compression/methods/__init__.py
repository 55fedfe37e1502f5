"""One module per family; importing this package registers every compressor. ``count_for``: how many elements a
sparsifier keeps at a ratio (what benchmarks compare against)."""

from trainscale.compression.methods import dense, dgc, powersgd, quantize, sign, sparse  # noqa: F401
from trainscale.compression.methods.sparse import count_for

__all__ = ["count_for"]
