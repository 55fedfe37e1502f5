"""One module per family; importing this package registers every compressor."""

from trainscale.compression.methods import dense, dgc, powersgd, quantize, sign, sparse  # noqa: F401
