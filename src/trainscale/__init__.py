"""trainscale: train image classifiers on one process, many processes and many machines, and measure it."""

__version__ = "0.1.0"
