"""Benchmark helpers: timing with warm-up excluded, repeats with mean and spread, results saved with
their configuration and environment."""
